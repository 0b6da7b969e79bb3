// DACP dashboard, keys panel: the inference API keys (GET /api/admin/api-keys) with their
// terms and state, creating one (its key is shown once, here, and never again) and revoking
// one. Plain ES2020, no build step.

const LIMITS = [
  ["requests_per_minute", "rpm"],
  ["tokens_per_minute", "tpm"],
  ["concurrent_requests", "concurrent"],
  ["monthly_tokens", "month"],
];

export function createKeys({ api, failed, toast, el, root }) {
  const state = { keys: [], busy: false };

  function limitsText(limits) {
    const parts = LIMITS.filter(([field]) => limits[field] != null).map(
      ([field, label]) => `${label} ${Number(limits[field]).toLocaleString()}`,
    );
    return parts.length ? parts.join(" · ") : "none";
  }

  function stateCell(key) {
    if (key.revoked) {
      return el("span", { class: "no", title: key.revoke_reason || "", text: "revoked" });
    }
    return key.active ? el("span", { class: "yes", text: "active" }) : el("span", { class: "late", text: "expired" });
  }

  function row(key) {
    return el(
      "tr",
      { dataset: { key: key.id } },
      el(
        "td",
        {},
        el("span", { class: "name", text: key.name }),
        el("span", { class: "sub mono", text: key.id }),
      ),
      el("td", { text: key.owner || "—" }),
      el("td", { class: "models", text: key.models ? key.models.join(", ") : "every model" }),
      el("td", { class: "limits", text: limitsText(key.limits) }),
      el("td", { text: key.priority }),
      el("td", { text: key.expires_at ? key.expires_at.slice(0, 19).replace("T", " ") : "never" }),
      el("td", { class: "state" }, stateCell(key)),
      el(
        "td",
        {},
        key.revoked
          ? null
          : el("button", {
              type: "button",
              class: "danger small revoke",
              text: "Revoke",
              title: `Revoke ${key.name}: it fails at once`,
              onclick: () => revoke(key),
            }),
      ),
    );
  }

  function render() {
    root.querySelector("#keys-table").tBodies[0].replaceChildren(...state.keys.map(row));
    root.querySelector("#keys-empty").hidden = state.keys.length > 0;
    const live = state.keys.filter((k) => k.active).length;
    root.querySelector("#keys-count").textContent = state.keys.length
      ? `${live} active of ${state.keys.length}`
      : "";
  }

  async function refresh() {
    try {
      state.keys = (await api("/api/admin/api-keys")).data;
      render();
    } catch (error) {
      failed(error);
    }
  }

  async function act(what, path, body) {
    if (state.busy) {
      toast(`${what}: wait for the action in progress`, true);
      return null;
    }
    state.busy = true;
    try {
      return await api(path, { method: "POST", body: JSON.stringify(body) });
    } catch (error) {
      failed(error);
      return null;
    } finally {
      state.busy = false;
    }
  }

  async function revoke(key) {
    if (!window.confirm(`Revoke the key ${key.name}? Requests with it fail at once, for good.`)) return;
    if (await act(`revoke ${key.name}`, `/api/admin/api-keys/${key.id}/revoke`, {})) {
      toast(`revoked ${key.name}`);
      await refresh();
    }
  }

  // The key just created: shown once, until the operator dismisses it or creates another.
  function showCreated(created) {
    const box = root.querySelector("#key-created");
    box.replaceChildren(
      el("p", { class: "warn", text: `The key of ${created.name}. Copy it now: it is not shown again.` }),
      el("code", { id: "new-key", class: "mono", text: created.key }),
      el("button", {
        type: "button",
        class: "secondary small",
        text: "Copy",
        onclick: async () => {
          try {
            await navigator.clipboard.writeText(created.key);
            toast("Copied.");
          } catch {
            toast("Select the key and copy it with Ctrl+C.", true);
          }
        },
      }),
      el("button", {
        type: "button",
        class: "secondary small",
        text: "Done",
        onclick: () => box.replaceChildren(),
      }),
    );
  }

  root.querySelector("#key-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const form = event.currentTarget;
    const value = (name) => form.elements.namedItem(name).value.trim();
    const body = { name: value("name"), priority: value("priority") };
    if (value("owner")) body.owner = value("owner");
    const models = value("models").split(",").map((m) => m.trim()).filter(Boolean);
    if (models.length) body.models = models;
    const limits = {};
    for (const [field] of LIMITS) if (value(field)) limits[field] = Number(value(field));
    if (Object.keys(limits).length) body.limits = limits;
    if (value("expires_at")) body.expires_at = new Date(value("expires_at")).toISOString();
    const created = await act(`create ${body.name}`, "/api/admin/api-keys", body);
    if (created) {
      form.reset();
      showCreated(created);
      await refresh();
    }
  });

  return {
    show() {
      refresh();
    },
    hide() {},
    reset() {
      state.keys = [];
      root.querySelector("#key-created").replaceChildren();
    },
  };
}
