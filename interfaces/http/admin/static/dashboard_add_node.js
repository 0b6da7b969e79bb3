// DACP dashboard, "Add a node": mints an enrollment token (POST /api/admin/enrollment-tokens)
// and shows the node-agent command line to run on the new machine, with the control channel's
// address from GET /api/admin/agent-setup. Plain ES2020, no build step.

// The agent's own default (agent/main.py default_data_dir on Linux and macOS).
const DEFAULT_DATA_DIR = "~/.local/share/dacp-agent";

// One shell word: left as it is when plain (a leading ~/ still expands), else single-quoted.
function shellWord(text) {
  if (/^[A-Za-z0-9_@%+=:,./~-]+$/.test(text)) return text;
  return `'${text.replaceAll("'", "'\\''")}'`;
}

export function agentCommand({ controllerUrl, token, nodeName, dataDir, tls }) {
  const words = ["node-agent", "--controller-url", controllerUrl, "--enrollment-token", token];
  if (nodeName) words.push("--node-name", nodeName);
  words.push("--data-dir", dataDir || DEFAULT_DATA_DIR);
  if (!tls) words.push("--insecure");
  return words.map(shellWord).join(" ");
}

export function createAddNode({ api, failed, toast, el, root }) {
  const form = root.querySelector("#add-node-form");
  form.elements.namedItem("data_dir").value = DEFAULT_DATA_DIR;

  async function copy(text) {
    try {
      await navigator.clipboard.writeText(text);
      toast("Copied.");
    } catch {
      // No clipboard outside a secure context (plain http beyond localhost): select it instead.
      const range = document.createRange();
      range.selectNodeContents(root.querySelector("#agent-command"));
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      toast("Selected: copy it with Ctrl+C.");
    }
  }

  async function mint(event) {
    event.preventDefault();
    const button = form.querySelector("button[type=submit]");
    button.disabled = true;
    const nodeName = form.elements.namedItem("node_name").value.trim();
    const body = {
      ttl_seconds: Number(form.elements.namedItem("ttl").value),
      single_use: form.elements.namedItem("single_use").checked,
    };
    if (nodeName) body.node_name = nodeName;
    try {
      const setup = await api("/api/admin/agent-setup");
      const minted = await api("/api/admin/enrollment-tokens", {
        method: "POST",
        body: JSON.stringify(body),
      });
      const command = agentCommand({
        controllerUrl: setup.controller_url,
        token: minted.token,
        nodeName,
        dataDir: form.elements.namedItem("data_dir").value.trim(),
        tls: setup.tls,
      });
      const notes = [];
      if (setup.loopback_only) {
        notes.push(
          "The control channel listens on loopback (GRPC_HOST): only an agent on this machine " +
            "reaches it. Set GRPC_HOST to a LAN address (or 0.0.0.0) for other machines.",
        );
      }
      if (!setup.tls) notes.push("The controller runs without TLS (GRPC_INSECURE): so does the agent.");
      const expires = new Date(minted.expires_at * 1000).toLocaleString();
      root.querySelector("#add-node-result").replaceChildren(
        el("h3", { text: "Enrollment token" }),
        el("code", { id: "enrollment-token", class: "token mono", text: minted.token }),
        el("p", {
          class: "muted",
          text: `id ${minted.token_id} · ${minted.single_use ? "one enrollment" : "any number of enrollments"}${
            minted.node_name ? ` · for node ${minted.node_name} only` : ""
          } · expires ${expires}. It is shown once: the controller keeps only its id.`,
        }),
        el("h3", { text: "On the new node, run" }),
        el("pre", { id: "agent-command", class: "command mono", text: command }),
        el("button", { type: "button", class: "secondary small", text: "Copy", onclick: () => copy(command) }),
        ...notes.map((note) => el("p", { class: "note", text: note })),
        el("p", {
          class: "muted",
          text: "The node appears in the Cluster tab once it has enrolled; later starts need no token.",
        }),
      );
    } catch (error) {
      failed(error);
    } finally {
      button.disabled = false;
    }
  }

  // Before any token: where agents will connect, and whether a token can be minted at all.
  async function preview() {
    try {
      const setup = await api("/api/admin/agent-setup");
      const line = root.querySelector("#add-node-target");
      line.textContent = setup.enrollment_enabled
        ? `Agents connect to ${setup.controller_url} (${setup.tls ? "TLS, pinned to this controller's CA" : "plaintext"}).`
        : "Enrollment is off: the controller has no NODE_ENROLLMENT_SECRET.";
      line.classList.toggle("note", !setup.enrollment_enabled);
      form.querySelector("button[type=submit]").disabled = !setup.enrollment_enabled;
    } catch (error) {
      failed(error);
    }
  }

  form.addEventListener("submit", mint);
  return {
    show() {
      preview();
    },
    hide() {},
    reset() {
      root.querySelector("#add-node-result").replaceChildren();
      form.reset();
      form.elements.namedItem("data_dir").value = DEFAULT_DATA_DIR;
    },
  };
}
