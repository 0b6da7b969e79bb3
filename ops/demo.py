"""The demo: a local two-agent cluster answers a real streamed chat completion, split
across both agents over llama.cpp RPC, through the official OpenAI SDK.

    make demo        # or: python -m ops.demo

It builds llama.cpp and fetches the model on first use (with progress), starts the
cluster, registers the model, streams the completion while printing tokens as they
arrive, prints the job's plan and event timeline, and shuts everything down.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import httpx
from openai import OpenAI

from ops import artifacts, paths
from ops.local_cluster import (
    MODEL_NAME,
    ClusterConfig,
    ClusterError,
    LocalCluster,
    ShutdownRequested,
    install_shutdown_signals,
)

PROMPT = "In two sentences, why do distributed systems need heartbeats?"


def _job_id(completion_id: str) -> str:
    hexid = completion_id.removeprefix("chatcmpl-")
    return f"{hexid[:8]}-{hexid[8:12]}-{hexid[12:16]}-{hexid[16:20]}-{hexid[20:]}"


def run_demo(config: ClusterConfig | None = None) -> dict[str, Any]:
    print("== preparing llama.cpp and the model (cached after the first run)", flush=True)
    artifacts.ensure_llama()
    artifacts.ensure_model()
    print("== starting a local cluster: controller + agent-a (model) + agent-b (RPC worker)")
    with LocalCluster(config or ClusterConfig()) as cluster:
        client = OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.ai_api_key)
        print(f"\n== streaming from {cluster.url}/v1 (model {MODEL_NAME})\n> {PROMPT}\n")
        started = time.monotonic()
        first: float | None = None
        text: list[str] = []
        completion_id = ""
        usage: Any = None
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=96,
            temperature=0.2,
            seed=7,
        )
        for chunk in stream:
            completion_id = chunk.id
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                piece = choice.delta.content or ""
                if piece:
                    first = first or time.monotonic()
                    text.append(piece)
                    print(piece, end="", flush=True)
        elapsed = time.monotonic() - started
        print("\n")
        job_id = _job_id(completion_id)
        admin = {"Authorization": f"Bearer {cluster.admin_api_key}"}
        job = httpx.get(f"{cluster.url}/api/admin/jobs/{job_id}", headers=admin, timeout=10)
        events = httpx.get(
            f"{cluster.url}/api/admin/jobs/{job_id}/events", headers=admin, timeout=10
        )
        job_row = job.json() if job.status_code == 200 else {}
        timeline = events.json() if events.status_code == 200 else {}
        plan = job_row.get("plan") or {}
        nodes = [plan.get("primary", {}).get("node_id")] + [
            w.get("node_id") for w in plan.get("workers", [])
        ]
        print(
            f"== job {job_id}: {job_row.get('state')} on {len(nodes)} node(s), "
            f"tensor split {plan.get('tensor_split')}"
        )
        if first is not None and usage is not None:
            print(
                f"   time to first token {1000 * (first - started):.0f} ms, "
                f"{usage.completion_tokens} tokens in {elapsed:.2f} s"
            )
        print("== event timeline")
        for event in timeline.get("data", []):
            print(f"   {event['time']}  {event['code']:<22} {event.get('summary', '')}")
        print("== shutting down")
        return {"text": "".join(text), "job": job_row, "timeline": timeline, "nodes": nodes}


def main() -> int:
    install_shutdown_signals()
    try:
        result = run_demo()
    except (ClusterError, httpx.HTTPError, paths.FetchError) as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, ShutdownRequested):
        print("demo interrupted; the cluster was shut down", file=sys.stderr)
        return 130
    if not result["text"] or len(result["nodes"]) < 2:
        print("demo failed: no text, or the job was not split across both agents", file=sys.stderr)
        return 1
    print("demo finished: the completion was split across both agents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
