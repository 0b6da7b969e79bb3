"""Statistics and plain-text formatting for the benchmarks (pure functions, no I/O)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MISSING = "-"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks.

    Same definition as NumPy's default (``method="linear"``): for ``n`` sorted values the
    rank is ``q / 100 * (n - 1)``. Raises ``ValueError`` on an empty input or ``q`` outside
    ``[0, 100]``.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0 or math.isnan(q):
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    fraction = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


@dataclass(frozen=True)
class Summary:
    n: int
    median: float
    p90: float
    mean: float
    min: float
    max: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(values: Sequence[float | None]) -> Summary | None:
    """Median, p90, mean, min and max of the values that are not ``None``; None if none are."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return Summary(
        n=len(present),
        median=percentile(present, 50.0),
        p90=percentile(present, 90.0),
        mean=statistics.fmean(present),
        min=min(present),
        max=max(present),
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def paired(
    numerator: Mapping[int, float | None], denominator: Mapping[int, float | None]
) -> list[tuple[float, float]]:
    """``(numerator, denominator)`` value pairs for the keys (prompt indices) both have."""
    return [
        (num, den)
        for key in sorted(numerator.keys() & denominator.keys())
        if (num := numerator[key]) is not None and (den := denominator[key]) is not None
    ]


def paired_ratio_median(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Median of the per-pair ratios (pairs with a zero denominator are skipped)."""
    ratios = [num / den for num, den in pairs if den != 0]
    return percentile(ratios, 50.0) if ratios else None


def paired_difference_median(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Median of ``numerator - denominator`` over the pairs."""
    return percentile([num - den for num, den in pairs], 50.0) if pairs else None


def fmt(value: float | int | None, digits: int = 1, *, scale: float = 1.0) -> str:
    """A number with fixed decimals (after multiplying by ``scale``), or ``-`` if missing."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return MISSING
    if isinstance(value, int) and scale == 1.0:
        return str(value)
    return f"{value * scale:.{digits}f}"


def fmt_ratio(value: float | None) -> str:
    """A ratio as ``1.234x``, or ``-`` if missing."""
    return MISSING if value is None else f"{value:.3f}x"


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, align: str | None = None
) -> str:
    """A plain-text table: one header row, a rule, then the rows.

    ``align`` has one character per column, ``l`` or ``r``; by default the first column is
    left-aligned and the others right-aligned. Every row must have one cell per header.
    """
    columns = len(headers)
    if align is None:
        align = "l" + "r" * (columns - 1)
    if len(align) != columns or set(align) - {"l", "r"}:
        raise ValueError(f"align must be {columns} characters of 'l'/'r', got {align!r}")
    for row in rows:
        if len(row) != columns:
            raise ValueError(f"row has {len(row)} cells for {columns} columns: {list(row)!r}")
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(width) if a == "l" else cell.rjust(width)
            for cell, width, a in zip(cells, widths, align, strict=True)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def human_bytes(count: int | None) -> str:
    """``1536 -> '1.5 KiB'``; binary units."""
    if count is None:
        return MISSING
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def json_safe(value: Any) -> Any:
    """Replace non-finite floats (which JSON cannot hold) with None, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
