"""Link probes: what the controller and the agents share to measure the links between nodes.

The controller asks an agent (``ProbeLinks``) to measure its links to its peers; the agent
connects to each peer's model file server (:mod:`common.model_file_server`) a few times for
the round trip and downloads ``GET /probe/<bytes>`` for the bandwidth, with a transfer ticket
(:mod:`common.transfer_ticket`) whose subject is :data:`PROBE_SUBJECT` instead of a model's
sha256. The answers (``LinkReport``) are recorded on the prober's node (``NODE_LINKS_MEASURED``)
and the split planner prefers the fastest links.

Imports only the standard library: part of the wire contract.
"""

from __future__ import annotations

#: The "model" a probe ticket names: no file has this sha256 (it is not hexadecimal).
PROBE_SUBJECT = "link-probe"
#: The path a file server answers probes on: ``/probe/<bytes>`` streams that many zero bytes.
PROBE_PATH = "/probe/"
#: The most bytes one probe may ask for (a probe must stay cheap for the peer).
MAX_PROBE_BYTES = 16 << 20
#: What a probe downloads by default: enough to see a 1 Gbit/s link's rate, little on a slow one.
DEFAULT_PROBE_BYTES = 4 << 20
#: TCP connects per peer for the round trip; the least is kept.
RTT_SAMPLES = 5
