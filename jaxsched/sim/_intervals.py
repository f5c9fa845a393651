"""Time intervals ``(start, end)``: unions, overlaps and differences.

Both readers of a schedule need them: `jaxsched.check._inspection` (how long a compiled
program's collectives run with no compute) and `jaxsched.tools.bench` (where a measured
host-engine step's time went).

Example:
    >>> union([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)])
    [(0.0, 3.0), (5.0, 6.0)]
    >>> total([(0.0, 3.0), (5.0, 6.0)]), overlap([(0.0, 3.0)], [(2.0, 6.0)])
    (4.0, 1.0)
    >>> subtract([(0.0, 4.0)], [(1.0, 2.0)])
    [(0.0, 1.0), (2.0, 4.0)]
"""

from __future__ import annotations

__all__ = ["Interval", "overlap", "subtract", "total", "union"]

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """The intervals merged where they touch or overlap, sorted; empty ones dropped."""
    merged: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def total(intervals: list[Interval]) -> float:
    """Summed length (of disjoint intervals, e.g. a `union`)."""
    return sum(b - a for a, b in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Time covered by both ``a`` and ``b``."""
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in union(a) for s2, e2 in union(b))


def subtract(busy: list[Interval], cover: list[Interval]) -> list[Interval]:
    """The parts of the union of ``busy`` outside the union of ``cover``."""
    cover = union(cover)
    parts = []
    for a, b in union(busy):
        for c, d in cover:
            if d <= a or c >= b:
                continue
            if c > a:
                parts.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            parts.append((a, b))
    return parts
