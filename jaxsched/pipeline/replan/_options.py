"""The options of ``schedule(..., replan=)`` and what re-planning reports.

`Replan` says when and how a scheduled step re-plans; `SwitchRecord` and `Decision` are
what ``sched.replans`` and ``sched.replan_decisions`` list.

Example:
    >>> r = Replan(every=20, drift=0.3)
    >>> r.every, r.drift, r.min_gain, r.monitor
    (20, 0.3, 0.05, 'auto')
    >>> Replan(every=0)
    Traceback (most recent call last):
    ...
    jaxsched.JaxschedValueError: Replan(every=0): every must be an int >= 1 (steps between measurements)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import numpy as np

from jaxsched._errors import JaxschedError, JaxschedValueError

__all__ = ["as_replan", "Decision", "MONITORS", "Replan", "ReplanAgreementError", "SwitchRecord"]


MONITORS = ("auto", "probe", "stages")


@dataclasses.dataclass(frozen=True)
class Replan:
    """When and how a scheduled step re-plans its buckets while it trains.

    Attributes:
      every: steps between two measurements (each one a decision point).
      drift: relative change of the plan's average bucket cost (measured vs assumed) above
        which the planner runs again.
      min_gain: the simulator's predicted relative step-time gain the new plan must reach
        before the step switches to it.
      window: measurements kept in the sliding window.
      repeats: timings of each probe collective per measurement (the fastest is kept).
      probe_bytes: the two probe sizes, bytes per collective: a small one that costs about
        α, a large one that costs mostly β.
      timeout_s: how long a process waits for the others' estimates before it raises.
      monitor: where measurements come from: ``"probe"`` (probe collectives, any engine),
        ``"stages"`` (the host engine's own collective stages, timed on the ``repeats``
        steps before each decision point: no extra traffic) or ``"auto"`` (stages on the
        host engine, the probe elsewhere).

    Raises:
      JaxschedValueError: a field out of its range, naming the field and what it must be.

    Example:
      >>> import jaxsched
      >>> r = jaxsched.Replan(every=20, drift=0.3)
      >>> r.every, r.min_gain, r.probe_bytes
      (20, 0.05, (4096, 2097152))

      Pass it as ``jaxsched.schedule(step, replan=r)`` (``replan="auto"``: the defaults).
    """

    every: int = 50
    drift: float = 0.2
    min_gain: float = 0.05
    window: int = 3
    repeats: int = 3
    probe_bytes: tuple[int, int] = (1 << 12, 1 << 21)
    timeout_s: float = 120.0
    monitor: str = "auto"

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> JaxschedValueError:
            return JaxschedValueError(f"Replan({field}={getattr(self, field)!r}): {field} must be {why}")

        def is_int(x: Any) -> bool:
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float, np.number)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.every) or self.every < 1:
            raise bad("every", "an int >= 1 (steps between measurements)")
        if not is_num(self.drift) or self.drift <= 0:
            raise bad("drift", "a number > 0 (relative change of the network, e.g. 0.2)")
        if not is_num(self.min_gain) or not 0 <= self.min_gain < 1:
            raise bad("min_gain", "a number in [0, 1) (predicted relative gain, e.g. 0.05)")
        if not is_int(self.repeats) or self.repeats < 1:
            raise bad("repeats", "an int >= 1")
        if not is_int(self.window) or self.window < 1:
            raise bad("window", "an int >= 1 (measurements kept)")
        sizes = tuple(self.probe_bytes) if isinstance(self.probe_bytes, (tuple, list)) else ()
        if len(sizes) != 2 or not all(is_int(s) and s >= 64 for s in sizes) or sizes[0] >= sizes[1]:
            raise bad("probe_bytes", "two increasing sizes in bytes, each >= 64")
        object.__setattr__(self, "probe_bytes", (int(sizes[0]), int(sizes[1])))
        if not is_num(self.timeout_s) or self.timeout_s <= 0:
            raise bad("timeout_s", "a number of seconds > 0")
        if self.monitor not in MONITORS:
            raise bad("monitor", f"one of {', '.join(map(repr, MONITORS))}")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))


def as_replan(value: Any) -> Replan | None:
    """``schedule(replan=...)`` as a `Replan`: None (off), ``"auto"`` (the defaults) or
    a `Replan`.

    >>> as_replan("auto") == Replan(), as_replan(None)
    (True, None)
    """
    if value is None or isinstance(value, Replan):
        return value
    if isinstance(value, str) and value == "auto":
        return Replan()
    raise JaxschedValueError(
        f"replan={value!r} is not understood; pass None, 'auto' or jaxsched.Replan(every=..., drift=..., min_gain=...)"
    )


class SwitchRecord(NamedTuple):
    """One switch of plan (``sched.replans``).

    Attributes:
      step: the number of steps run before the new plan's first step.
      reason: ``"measured"`` (drift seen by the monitor) or ``"requested"`` (``sched.replan``).
      network: what the new plan was made for: ``"measured"`` or the preset's name.
      alpha_beta: per collective the strategy sends, the network's α-β the new plan was made
        for, measured or given (``{"all_reduce": (alpha_s, beta_s_per_byte)}``; the engine's
        fixed cost per collective, which planning adds to α, is not included).
      drift: the measured drift that triggered it (0 for a requested switch without a measurement).
      old_buckets, new_buckets: the plans, as lists of parameter paths.
      predicted_old_s, predicted_new_s: the simulator's step time of each plan on that network.
      predicted_gain: ``1 - new / old``.
      reused: whether the new plan's program was compiled before (no recompile).
      first_step_s: wall time of the new plan's first step (tracing and compiling included
        when not reused).

    Example:
      >>> from jaxsched.pipeline import replan
      >>> rec = replan.SwitchRecord(
      ...     100, "measured", "measured", {"all_reduce": (5e-5, 1e-9)}, 0.4,
      ...     (("a", "b"),), (("a",), ("b",)), 2.0e-3, 1.5e-3, 0.25)
      >>> rec.predicted_gain == 1 - rec.predicted_new_s / rec.predicted_old_s, rec.reused
      (True, False)
    """

    step: int
    reason: str
    network: str
    alpha_beta: Mapping[str, tuple[float, float]]
    drift: float
    old_buckets: tuple[tuple[str, ...], ...]
    new_buckets: tuple[tuple[str, ...], ...]
    predicted_old_s: float
    predicted_new_s: float
    predicted_gain: float
    reused: bool = False
    first_step_s: float | None = None


class Decision(NamedTuple):
    """One decision point of the monitor (``sched.replan_decisions``).

    Attributes:
      step: steps run when it was taken.
      drift: the measured drift (see `drift_between`).
      predicted_gain: the simulator's gain of the re-planned buckets (None: drift below the
        threshold, the planner did not run; 0 when it chose the current plan).
      switched: whether a switch was scheduled for the next step.
      seconds: wall time of the decision: the probe, the agreement and any planning.

    Example:
      >>> from jaxsched.pipeline import replan
      >>> d = replan.Decision(step=50, drift=0.05, predicted_gain=None, switched=False, seconds=0.01)
      >>> d.predicted_gain is None  # below the drift threshold: the planner did not run
      True
    """

    step: int
    drift: float
    predicted_gain: float | None
    switched: bool
    seconds: float


class ReplanAgreementError(JaxschedError, RuntimeError):
    """The processes could not agree on a re-planning decision (a message was lost,
    unreadable, or from another step); every process that waited for it raises.

    Raising on every process, instead of going on with a local decision, keeps the processes
    on one plan: two plans would deadlock in their first mismatched collective.

    Example:
      >>> import jaxsched
      >>> issubclass(jaxsched.ReplanAgreementError, (jaxsched.JaxschedError, RuntimeError))
      True
    """
