"""Choosing the benchmark's batch: compute-only time close to comm-only time (`calibrate_batch`).

Overlap can only show when neither side dominates, and these machines' speed moves by 2x
from day to day: `jaxsched bench` calibrates the batch per process before it measures.

Example (compute = 50 ms fixed + 0.1 ms per row, comm 200 ms):
    >>> cal = calibrate_batch(lambda b: (0.05 + 1e-4 * b, 0.2), 128)
    >>> cal.converged, cal.batch % 8
    (True, 0)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from jaxsched._errors import JaxschedValueError

__all__ = ["Calibration", "calibrate_batch"]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The outcome of `calibrate_batch`.

    ``error`` is ``compute_s / comm_s - 1`` at the chosen ``batch``; ``probes`` lists every
    ``(batch, compute_s, comm_s)`` measured, in order; ``converged`` says whether
    ``|error| <= tolerance``; ``reason`` says why not when it is False.
    """

    batch: int
    compute_s: float
    comm_s: float
    error: float
    probes: list[tuple[int, float, float]]
    converged: bool
    tolerance: float
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_ratio": 1.0,
            "achieved_ratio": self.compute_s / self.comm_s,
            "error": self.error,
            "tolerance": self.tolerance,
            "converged": self.converged,
            "batch": self.batch,
            "reason": self.reason,
            "probes": [{"batch": b, "compute_s": c, "comm_s": m} for b, c, m in self.probes],
        }


def calibrate_batch(
    measure: Callable[[int], tuple[float, float]],
    start: int,
    *,
    tolerance: float = 0.10,
    max_probes: int = 6,
    multiple: int = 8,
    max_batch: int = 1 << 16,
    max_growth: float = 16.0,
) -> Calibration:
    """Find a batch whose compute-only time is within ``tolerance`` of comm-only time.

    Why iterate: compute time is ``fixed + per_row * batch``, and at small batches the fixed
    part (dispatch, the optimizer update, the loss pmean) dominates, so one probe
    extrapolated linearly lands far off (compute 91 ms against comm 291 ms, in one calibration).
    This runs the secant method on ``g = log(compute / comm)`` against ``log(batch)``,
    and once probes bracket the root, keeps the step inside the bracket (bisecting in log
    space when the secant step would leave it). The first step, with one probe, assumes
    compute proportional to batch. Batches are multiples of ``multiple`` (the bench needs
    them divisible by its devices) in ``[multiple, max_batch]``; a step grows the batch by
    at most ``max_growth`` times.

    ``measure(batch) -> (compute_s, comm_s)``; it is called at most ``max_probes`` times.
    Returns the probe closest to the target; ``converged`` is False, with a ``reason``,
    when no probe came within ``tolerance`` (the curve cannot reach it within the bounds,
    the batch granularity is too coarse, or the probes ran out).

    Example (compute = 50 ms fixed + 0.1 ms per row, comm 200 ms):
        >>> cal = calibrate_batch(lambda b: (0.05 + 1e-4 * b, 0.2), 128)
        >>> cal.converged, abs(cal.error) <= 0.1, len(cal.probes) <= 6
        (True, True, True)
    """
    if start < 1 or multiple < 1 or max_probes < 1:
        raise JaxschedValueError(
            f"calibrate_batch: start={start}, multiple={multiple}, max_probes={max_probes} must all be >= 1"
        )
    lo_b, hi_b = multiple, max(multiple, max_batch // multiple * multiple)

    def snap(x: float) -> int:
        return int(min(hi_b, max(lo_b, round(x / multiple) * multiple)))

    probes: list[tuple[int, float, float]] = []
    reason = None
    batch = snap(start)
    while True:
        compute_s, comm_s = measure(batch)
        if not (compute_s > 0 and comm_s > 0):
            raise JaxschedValueError(
                f"calibrate_batch: measure({batch}) returned compute {compute_s!r}, "
                f"comm {comm_s!r}; both must be positive seconds"
            )
        probes.append((batch, float(compute_s), float(comm_s)))
        if abs(compute_s / comm_s - 1) <= tolerance:
            break
        if len(probes) >= max_probes:
            reason = f"{max_probes} probes did not bring compute within {tolerance:.0%} of comm"
            break
        # g(batch) = compute/comm - 1 is about linear in batch (comm does not depend on it)
        pts = sorted((b, c / m - 1) for b, c, m in probes)
        below = [p for p in pts if p[1] < 0]  # compute shorter than comm
        above = [p for p in pts if p[1] > 0]
        if below and above and below[-1][0] < above[0][0]:
            (x0, g0), (x1, g1) = below[-1], above[0]  # the tightest bracket
            x = x0 - g0 * (x1 - x0) / (g1 - g0)
            width = x1 - x0
            if not x0 + 0.1 * width < x < x1 - 0.1 * width:  # secant stalls near an end: bisect
                x = math.sqrt(x0 * x1)
        else:
            x_last, g_last = probes[-1][0], probes[-1][1] / probes[-1][2] - 1
            x = x_last * probes[-1][2] / probes[-1][1]  # one probe: compute proportional to batch
            if len(probes) > 1:
                xa, ga = probes[-2][0], probes[-2][1] / probes[-2][2] - 1
                if xa != x_last and (ga - g_last) / (xa - x_last) > 0:
                    x = x_last - g_last * (xa - x_last) / (ga - g_last)
            x = min(max(x, x_last / max_growth), x_last * max_growth)
        nxt = snap(x)
        if nxt in (b for b, _, _ in probes):
            reason = (
                f"the batch bound [{lo_b}, {hi_b}] was reached"
                if nxt in (lo_b, hi_b)
                else f"batches are multiples of {multiple}: no untried batch is closer to the target"
            )
            break
        batch = nxt
    best = min(probes, key=lambda p: abs(math.log(p[1] / p[2])))
    error = best[1] / best[2] - 1
    converged = abs(error) <= tolerance
    if converged:
        reason = None
    else:
        side = "above" if error > 0 else "below"
        reason = (
            f"compute stays {side} comm ({best[1] * 1e3:.0f} ms against {best[2] * 1e3:.0f} ms "
            f"at batch {best[0]}): {reason}"
        )
    return Calibration(best[0], best[1], best[2], error, probes, converged, tolerance, reason)
