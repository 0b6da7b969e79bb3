"""Model transfer throughput over loopback, side by side with plain ``curl`` in one run.

Node A serves a file (``common/model_file_server.py``: TLS with the node certificates the
controller's CA issues, a transfer ticket, client certificates); node B fetches it with the
agent's fetcher (``agent/models/model_fetch.py``: TLS, sha256 of every byte, written to disk, fsync,
rename), and ``curl`` downloads the same file from the same server with the same
certificate, key and ticket (TLS, written to disk, no hashing). ``curl`` does not fsync, so a
second figure adds an fsync of its file to its time: the same durability the fetcher gives
before it renames. Rounds alternate; the medians and the ratios are printed, and written to
``var/bench/``.

    python -m bench.model_transfer                 # 512 MiB x 5 rounds
    python -m bench.model_transfer --mib 256 --rounds 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from agent.models.model_fetch import Source, fetch
from agent.node.node_tls import NodeTls
from common.model_file_server import ModelFileServer
from common.transfer_ticket import MODELS_PATH, Ticket, node_tls_name, sign_ticket
from infrastructure.tls import issue_node_cert, load_or_create


def node_identity(root: Path, ca_pem: bytes, ca_key: bytes, node_id: str) -> NodeTls:
    """Node ``node_id``'s TLS identity under ``root``, its certificate issued by the CA."""
    tls = NodeTls(root / node_id)
    tls.store(issue_node_cert(ca_pem, ca_key, node_id, tls.csr(node_id).encode()).decode())
    return tls


def serve_file(tls: NodeTls, ca_pem: bytes, model: Path, sha: str) -> ModelFileServer:
    """A started model file server on a free loopback port, with ``tls``'s identity, serving
    ``model`` as ``sha`` (and nothing else) to nodes of the CA ``ca_pem``."""
    return ModelFileServer(
        "127.0.0.1",
        0,
        tls.server_context(ca_pem.decode()),
        ca_pem.decode(),
        lambda wanted: model if wanted == sha else None,
    ).start()


def _file(path: Path, mib: int) -> str:
    hasher = hashlib.sha256()
    with path.open("wb") as out:
        for _ in range(mib):
            block = os.urandom(1 << 20)
            hasher.update(block)
            out.write(block)
    return hasher.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.model_transfer", description=__doc__)
    parser.add_argument("--mib", type=int, default=512, help="file size in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    curl = shutil.which("curl")
    if curl is None:
        print("curl is needed for the comparison", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dacp-transfer-", dir="/var/tmp") as scratch:
        root = Path(scratch)
        controller = load_or_create(root / "tls")
        assert controller.ca_key_pem is not None
        ca_pem, ca_key = controller.ca_pem, controller.ca_key_pem
        a, b = str(uuid.uuid4()), str(uuid.uuid4())
        a_tls, b_tls = (
            node_identity(root, ca_pem, ca_key, a),
            node_identity(root, ca_pem, ca_key, b),
        )
        model = root / "served.gguf"
        print(f"writing a {args.mib} MiB file ...", flush=True)
        sha = _file(model, args.mib)
        size = model.stat().st_size
        server = serve_file(a_tls, ca_pem, model, sha)
        (root / "ca.pem").write_bytes(ca_pem)
        ours: list[float] = []
        theirs: list[float] = []
        synced: list[float] = []
        try:
            for round_ in range(args.rounds):
                ticket = sign_ticket(ca_key, Ticket(sha, b, time.time() + 300))
                dest = root / "fetched.gguf"
                started = time.perf_counter()
                fetch(
                    Source(a, "127.0.0.1", server.port, ticket),
                    sha,
                    size,
                    dest,
                    b_tls.client_context(ca_pem.decode()),
                )
                ours.append(size / (time.perf_counter() - started) / 1e6)
                dest.unlink()
                name = node_tls_name(a)
                started = time.perf_counter()
                subprocess.run(
                    [
                        curl,
                        "--silent",
                        "--fail",
                        "--cacert",
                        str(root / "ca.pem"),
                        "--cert",
                        str(b_tls.cert_path),
                        "--key",
                        str(b_tls.key_path),
                        "--resolve",
                        f"{name}:{server.port}:127.0.0.1",
                        "-H",
                        f"Authorization: Bearer {ticket}",
                        "-o",
                        str(dest),
                        f"https://{name}:{server.port}{MODELS_PATH}{sha}",
                    ],
                    check=True,
                )
                theirs.append(size / (time.perf_counter() - started) / 1e6)
                with dest.open("rb") as written:
                    os.fsync(written.fileno())
                synced.append(size / (time.perf_counter() - started) / 1e6)
                assert dest.stat().st_size == size
                dest.unlink()
                print(
                    f"round {round_ + 1}/{args.rounds}: fetcher {ours[-1]:.0f} MB/s, "
                    f"curl {theirs[-1]:.0f} MB/s, curl + fsync {synced[-1]:.0f} MB/s",
                    flush=True,
                )
        finally:
            server.stop()
    result = {
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "file_mib": args.mib,
        "rounds": args.rounds,
        "fetcher_mb_s_median": round(statistics.median(ours), 1),
        "curl_mb_s_median": round(statistics.median(theirs), 1),
        "ratio_fetcher_to_curl": round(statistics.median(ours) / statistics.median(theirs), 3),
        "curl_fsync_mb_s_median": round(statistics.median(synced), 1),
        "ratio_fetcher_to_curl_fsync": round(
            statistics.median(ours) / statistics.median(synced), 3
        ),
    }
    print(
        f"\nmedian: fetcher (TLS + sha256 + disk + fsync) {result['fetcher_mb_s_median']} MB/s; "
        f"curl (TLS + disk) {result['curl_mb_s_median']} MB/s, ratio "
        f"{result['ratio_fetcher_to_curl']}x; curl + fsync {result['curl_fsync_mb_s_median']} "
        f"MB/s, ratio {result['ratio_fetcher_to_curl_fsync']}x"
    )
    out = Path("var/bench")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"model_transfer-{dt.datetime.now():%Y-%m-%dT%H%M%S}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
