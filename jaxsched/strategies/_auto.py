"""``auto``: the exact strategy the simulator predicts fastest for this step, here.

For each candidate (``allreduce``, ``wfbp``, ``dear`` by default: the exact ones), the
step's layers (FLOPs over a measured matmul rate, or a given ``layer_profile``) and the
network (measured on the step's own mesh, or a given ``network_profile``) are fed to the
simulator, with the bucket plan the candidate would run and with what the engine adds:
its fixed cost per collective (the host engine's stage dispatch) and whether collectives
overlap compute at all (not on the ``xla`` engine on CPU, where the simulator runs one
shared stream). The fastest prediction wins; ties go to the earlier candidate. The choice
is made once per traced step (`jaxsched.pipeline._selection`) and is reported in
``strategy.last_choice`` (simulated
seconds per candidate: SIMULATED, not measured).

With ``buckets=None`` or ``"auto"`` each candidate's buckets are planned too (the planned
paths then run); an explicit plan or a byte threshold is kept and only the strategy is
chosen.

Example:
    >>> Auto().candidates
    ('allreduce', 'wfbp', 'dear')
    >>> Auto(candidates=("wfbp", "nope"))
    Traceback (most recent call last):
    ...
    jaxsched.JaxschedValueError: strategy='auto' candidates: 'nope' is not a registered strategy (registered: ...)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NoReturn, Sequence

from jaxsched._errors import JaxschedRuntimeError, JaxschedValueError
from jaxsched.runtime.collectives._base import Collective
from jaxsched.sim._costmodel import WFBP_PATTERN
from jaxsched.plan._planned_step import PlannedStep
from jaxsched.strategies._base import ScheduledState, Strategy
from jaxsched.strategies._registry import make_strategy, register_strategy, strategy_names

__all__ = ["Auto", "AutoChoice"]


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` chose for one traced step.

    Attributes:
      chosen: the strategy's name.
      simulated_s: SIMULATED seconds per iteration for every candidate considered.
      overlaps: whether the engine lets collectives overlap compute (else one stream).
      per_collective_s: the engine's fixed cost per collective that the plan included.
      buckets: the bucket option the chosen strategy runs with.
      estimated_s: on GPU and TPU, XLA's estimated step per candidate (strategy and bucket
        option) compiled for the mesh; the choice then goes by it, and ``simulated_s`` is
        empty. An estimate, not a measurement.

    ``sched.program.strategy.last_choice`` holds it once ``auto`` has chosen.

    Example:
      >>> from jaxsched.strategies import AutoChoice
      >>> choice = AutoChoice("dear", {"wfbp": 2e-3, "dear": 1e-3}, overlaps=False, per_collective_s=0.0, buckets=None)
      >>> choice.chosen == min(choice.simulated_s, key=choice.simulated_s.get)
      True
    """

    chosen: str
    simulated_s: dict
    overlaps: bool
    per_collective_s: float
    buckets: Any
    estimated_s: dict = dataclasses.field(default_factory=dict)


@register_strategy
class Auto(Strategy):
    """Chooses among exact strategies by simulating the step on the measured machine.

    The choice is made when the step is first traced (see `AutoChoice`); the chosen
    strategy then runs the step.

    Args:
      collective: passed on to the chosen strategy.
      candidates: the registered strategies to choose among (not ``"auto"``).

    Example:
        >>> auto = Auto(candidates=("wfbp", "dear"))
        >>> [s.name for s in auto.candidate_strategies()]
        ['wfbp', 'dear']
    """

    name = "auto"
    cost = WFBP_PATTERN  # never planned against: selection hands over to the chosen strategy

    def __init__(self, collective: Collective | None = None, candidates: Sequence[str] = ("allreduce", "wfbp", "dear")):
        super().__init__(collective)
        self._given_collective = collective
        candidates = tuple(candidates)
        if not candidates:
            raise JaxschedValueError("strategy='auto' needs at least one candidate strategy")
        for name in candidates:
            if name == self.name or name not in strategy_names():
                raise JaxschedValueError(
                    f"strategy='auto' candidates: {name!r} is not a registered "
                    f"strategy (registered: {', '.join(strategy_names())})"
                )
        self.candidates = candidates
        self.last_choice: AutoChoice | None = None

    def candidate_strategies(self) -> list[Strategy]:
        """The candidates as strategies; those that cannot carry the given collective drop out.

        Returns:
          The candidate [`Strategy`][jaxsched.strategies.Strategy] instances, each with the given collective.

        Raises:
          JaxschedValueError: no candidate accepts the collective.

        Example:
            >>> import jaxsched
            >>> auto = Auto(collective=jaxsched.compress.TopK(density=0.1))
            >>> [s.name for s in auto.candidate_strategies()]  # allreduce takes no collective
            ['wfbp', 'dear']
        """
        built = []
        for name in self.candidates:
            try:
                built.append(make_strategy(name, collective=self._given_collective))
            except ValueError:  # e.g. allreduce cannot carry a compressor: not a candidate
                continue
        if not built:
            raise JaxschedValueError(
                f"no candidate of strategy='auto' ({', '.join(self.candidates)}) "
                f"accepts collective {type(self._given_collective).__name__}"
            )
        return built

    # Selection (jaxsched.pipeline._selection) replaces auto by the strategy it chose before any
    # program is built; these are never called.
    def convert(self, planned: PlannedStep, state: ScheduledState) -> NoReturn:
        raise JaxschedRuntimeError("strategy='auto' converts through the strategy it chose")

    def finalize(self, planned: PlannedStep, state: ScheduledState) -> NoReturn:
        raise JaxschedRuntimeError("strategy='auto' finalizes through the strategy it chose")

    def rewrite(self, planned: PlannedStep) -> NoReturn:
        raise JaxschedRuntimeError("strategy='auto' rewrites through the strategy it chose")
