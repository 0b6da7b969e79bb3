"""Per-key usage counters on ``GET /metrics`` (issue 25): requests, prompt tokens and
completion tokens by API key id and model.

They move with the events the projection follower applies (``PrometheusMetrics.on_event``),
so they count the whole cluster's jobs since this controller started, as the other event
counters do: a request at its ``JOB_SUBMITTED``, its tokens at its ``JOB_COMPLETED`` (a job
submitted before this controller started counts none). The durable figures are the usage
report's (``GET /api/admin/usage``, ``dacp usage``).

The cardinality is bounded: each process labels at most :data:`MAX_KEY_LABELS` distinct key
ids and :data:`MAX_MODEL_LABELS` distinct models, the first it sees; any later one is counted
as :data:`OTHER`. So each counter has at most ``(MAX_KEY_LABELS + 1) * (MAX_MODEL_LABELS + 1)``
series, whatever the number of keys.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

#: Distinct key ids labelled per process; later keys count as OTHER.
MAX_KEY_LABELS = 50
#: Distinct models labelled per process; later models count as OTHER.
MAX_MODEL_LABELS = 50
#: The label of every key id (or model) past the bound.
OTHER = "other"
#: The label of jobs recorded without a key id (before keys).
NO_KEY = "none"
#: Jobs remembered between their submission and their end (for their labels); past this,
#: the oldest are forgotten (a job that never ends cannot grow the map).
MAX_OPEN_JOBS = 100_000

_ENDINGS = frozenset({"JOB_COMPLETED", "JOB_FAILED", "JOB_CANCELLED", "JOB_REJECTED"})


class BoundedLabels:
    """Label values: the first ``limit`` distinct ones as they are, every later one OTHER."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kept: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._kept:
            return value
        if len(self._kept) < self.limit:
            self._kept.add(value)
            return value
        return OTHER


class KeyUsageCounters:
    """The three counters and the labels of the jobs not yet ended. Called from the
    follower's thread only."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["key", "model"]
        self.requests = Counter(
            "dacp_key_requests",
            f"Jobs submitted, by API key id and model (at most {MAX_KEY_LABELS} keys and "
            f"{MAX_MODEL_LABELS} models per process; later ones count as '{OTHER}').",
            labels,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "dacp_key_prompt_tokens",
            "Prompt tokens of completed jobs, by API key id and model (bounded as "
            "dacp_key_requests_total).",
            labels,
            registry=registry,
        )
        self.completion_tokens = Counter(
            "dacp_key_completion_tokens",
            "Completion tokens of completed jobs, by API key id and model (bounded as "
            "dacp_key_requests_total).",
            labels,
            registry=registry,
        )
        self.keys = BoundedLabels(MAX_KEY_LABELS)
        self.models = BoundedLabels(MAX_MODEL_LABELS)
        self._open: dict[str, tuple[str, str]] = {}

    def on_event(self, code: str, event: object) -> None:
        """One applied event (its catalog ``code``): a job's submission or its end."""
        job_id = str(getattr(event, "originator_id", ""))
        if code == "JOB_SUBMITTED":
            key = str(getattr(event, "key_id", "") or NO_KEY)
            labels = (self.keys(key), self.models(str(getattr(event, "model", ""))))
            self.requests.labels(*labels).inc()
            self._open[job_id] = labels
            if len(self._open) > MAX_OPEN_JOBS:
                del self._open[next(iter(self._open))]
        elif code in _ENDINGS:
            ended = self._open.pop(job_id, None)
            if ended is not None and code == "JOB_COMPLETED":
                self.prompt_tokens.labels(*ended).inc(_count(event, "prompt_tokens"))
                self.completion_tokens.labels(*ended).inc(_count(event, "completion_tokens"))


def _count(event: object, name: str) -> int:
    return max(0, int(getattr(event, name, 0) or 0))
