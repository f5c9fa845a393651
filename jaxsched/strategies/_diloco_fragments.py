"""When each DiLoCo fragment synchronizes: the fragment schedule of Streaming DiLoCo.

The parameters are cut into ``F`` fragments (contiguous leaves of about equal size). Every
``H`` inner steps each fragment sends its outer gradient once, at its own offset in the
cycle, and its mean arrives ``τ`` inner steps later. This module is the schedule alone, host
integers only, so that it can be read, tested and simulated without a step.

Example:
    >>> schedule = FragmentSchedule(inner_steps=8, fragments=4, overlap_steps=1)
    >>> schedule.offsets
    (2, 4, 6, 0)
    >>> [schedule.phase_key(s) for s in (1, 2, 3)]
    [(None, None), (0, 0), (None, None)]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxsched._errors import JaxschedValueError

__all__ = ["FragmentSchedule", "PhaseKey", "fragment_of_leaves", "sync_schedule"]

#: ``(sender, arriver)``: the fragment whose send opens a phase's program and the fragment
#: whose mean arrives at its end (None: no such fragment).
PhaseKey = tuple[int | None, int | None]


def fragment_of_leaves(sizes: Sequence[int], fragments: int) -> tuple[int, ...]:
    """The fragment of each parameter leaf: contiguous groups in flatten order, cut where
    the running size passes each ``k / fragments`` of the total (every fragment non-empty).

    Args:
      sizes: each parameter leaf's element count, in flatten order.
      fragments: how many fragments ``F``.

    Returns:
      Per leaf, its fragment in ``0 .. F - 1``.

    Example:
        >>> fragment_of_leaves([4, 4, 4, 4], 2), fragment_of_leaves([100, 1, 1, 1], 2)
        ((0, 0, 1, 1), (0, 1, 1, 1))
    """
    n = len(sizes)
    if fragments > n:
        raise JaxschedValueError(
            f"DiLoCo(fragments={fragments}): the step has only {n} parameter leaves; use fragments <= {n}"
        )
    total = float(sum(sizes))
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(sizes, np.float64))])
    starts = [0]
    for k in range(1, fragments):
        # the first leaf after the running size reached k/F of the total, leaving one leaf
        # for each later fragment and at least one for the previous
        b = int(np.searchsorted(prefix, total * k / fragments, side="left"))
        starts.append(min(max(b, starts[-1] + 1), n - (fragments - k)))
    out: list[int] = []
    for k, s in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else n
        out.extend([k] * (end - s))
    return tuple(out)


def sync_schedule(inner_steps: int, fragments: int) -> tuple[int, ...]:
    """``d_p`` per fragment: fragment ``p`` sends when the number of inner steps taken is
    ``≡ d_p (mod inner_steps)`` (and at least 1).

    Spread evenly over the cycle so that one fragment's outer all-reduce is in flight at a
    time, and the last fragment sends at the end of the cycle, as plain DiLoCo does.

    Args:
      inner_steps: ``H``.
      fragments: ``F`` (at most ``H``).

    Returns:
      ``(d_0, ..., d_{F-1})``.

    Example:
        >>> from jaxsched import strategies
        >>> strategies.sync_schedule(8, 4), strategies.sync_schedule(10, 1)
        ((2, 4, 6, 0), (0,))
    """
    return tuple(((p + 1) * inner_steps // fragments) % inner_steps for p in range(fragments))


@dataclasses.dataclass(frozen=True)
class FragmentSchedule:
    """The send and arrival of every fragment over the inner steps.

    Attributes:
      inner_steps: ``H``, inner steps between two sends of one fragment.
      fragments: ``F``, the number of fragments, at most ``H``.
      overlap_steps: ``τ``, inner steps a fragment's outer all-reduce is in flight.
    """

    inner_steps: int
    fragments: int
    overlap_steps: int = 0

    @property
    def offsets(self) -> tuple[int, ...]:
        """Per fragment, the step (mod ``H``) after which it sends (`sync_schedule`)."""
        return sync_schedule(self.inner_steps, self.fragments)

    def send_table(self) -> np.ndarray:
        """Per phase ``s mod H``: the fragment that sends after ``s`` inner steps, or ``F``."""
        table = np.full((self.inner_steps,), self.fragments, np.int32)
        for p, d in enumerate(self.offsets):
            table[d] = p
        return table

    @functools.cached_property
    def _table(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.send_table())

    def fragment_at(self, taken: int) -> int | None:
        """The fragment that sends after ``taken`` inner steps, or None."""
        if taken < 1:
            return None
        p = self._table[taken % self.inner_steps]
        return None if p == self.fragments else p

    def phase_key(self, step: int | None) -> PhaseKey:
        """Which fragment sends at the start and which arrives at the end of the program for
        inner step ``step`` (0-based). The programs differ only in that, so every phase with
        the same key shares one compiled program, with no condition around a collective.
        ``None``: the representative phase (the first that communicates)."""
        tau = self.overlap_steps
        if step is None:
            step = next(
                t for t in range(2 * self.inner_steps + tau + 1) if any(k is not None for k in self.phase_key(t))
            )
        sender = self.fragment_at(step) if tau >= 1 else None
        arriver = self.fragment_at(step + 1 - tau)
        return sender, arriver

    def in_flight_after(self, taken: int) -> int | None:
        """The fragment whose outer all-reduce is reduced but not yet applied after ``taken``
        inner steps: sent at ``S`` with ``taken - τ < S <= taken - 1`` (only with ``τ >= 2``)."""
        in_flight = None
        if self.overlap_steps >= 2:
            for sent in range(taken - self.overlap_steps + 1, taken):
                if self.fragment_at(sent) is not None:
                    in_flight = self.fragment_at(sent)
        return in_flight
