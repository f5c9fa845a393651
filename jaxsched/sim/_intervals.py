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
    """The intervals merged where they touch or overlap, sorted; empty ones dropped, so
    lengths can be summed without counting a moment twice.

    Args:
      intervals: ``(start, end)`` pairs, in any order.

    Returns:
      Disjoint intervals in increasing order.

    Example:
        >>> from jaxsched.sim import union
        >>> union([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (4.0, 4.0)])
        [(0.0, 3.0), (5.0, 6.0)]
    """
    merged: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def total(intervals: list[Interval]) -> float:
    """Summed length (of disjoint intervals, e.g. a `union`; overlapping ones count twice).

    Args:
      intervals: ``(start, end)`` pairs.

    Returns:
      The sum of ``end - start``.

    Example:
        >>> from jaxsched.sim import total, union
        >>> total([(0.0, 2.0), (1.0, 3.0)]), total(union([(0.0, 2.0), (1.0, 3.0)]))
        (4.0, 3.0)
    """
    return sum(b - a for a, b in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Time covered by both ``a`` and ``b``: how much communication hides behind compute.

    Args:
      a: intervals, overlapping or not.
      b: intervals, overlapping or not.

    Returns:
      The length of the intersection of their unions.

    Example:
        >>> from jaxsched.sim import overlap
        >>> overlap([(0.0, 3.0)], [(2.0, 6.0), (2.5, 4.0)])
        1.0
    """
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in union(a) for s2, e2 in union(b))


def subtract(busy: list[Interval], cover: list[Interval]) -> list[Interval]:
    """The parts of the union of ``busy`` outside the union of ``cover``: e.g. the time a
    collective runs with no compute to hide behind.

    Args:
      busy: intervals to keep parts of.
      cover: intervals to remove.

    Returns:
      Disjoint intervals in increasing order.

    Example:
        >>> from jaxsched.sim import subtract
        >>> subtract([(0.0, 4.0)], [(1.0, 2.0), (3.0, 5.0)])
        [(0.0, 1.0), (2.0, 3.0)]
    """
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
