"""A Prometheus histogram for figures observed on one thread, on the relay's hot path.

``prometheus_client.Histogram.observe`` takes a lock for the sum and another for the bucket:
a few microseconds for every relayed token message. The inter-token latency is observed by
the event loop only, so :class:`LoopHistogram` keeps plain counters instead (one bisect, two
additions) and builds the cumulative buckets when Prometheus scrapes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import accumulate

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class LoopHistogram(Collector):
    """A histogram with one writer thread (``observe``) and any reader (``collect``)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(buckets) or len(set(buckets)) != len(buckets):
            raise ValueError("histogram buckets must be strictly increasing")
        self.name = name
        self.documentation = documentation
        self._bounds = [float(b) for b in buckets]
        self._counts = [0] * (len(self._bounds) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        """Counts ``value`` in the first bucket whose upper bound (``le``) holds it."""
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Metric]:
        counts = list(self._counts)  # one C-level copy: no observation lands half-way in it
        cumulative = list(accumulate(counts))
        labels = [_le(bound) for bound in self._bounds] + ["+Inf"]
        yield HistogramMetricFamily(
            self.name,
            self.documentation,
            buckets=list(zip(labels, cumulative, strict=True)),
            sum_value=self._sum,
        )


def _le(bound: float) -> str:
    """The ``le`` label as prometheus_client writes it (``0.001``, ``1.0``)."""
    return repr(bound)
