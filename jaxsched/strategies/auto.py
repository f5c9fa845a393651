"""``auto``: the exact strategy the simulator predicts fastest for this step, here.

For each candidate (``allreduce``, ``wfbp``, ``dear`` by default: the exact ones), the
step's layers (FLOPs over a measured matmul rate, or a given ``layer_profile``) and the
network (measured on the step's own mesh, or a given ``network_profile``) are fed to the
simulator, with the bucket plan the candidate would run and with what the engine adds:
its fixed cost per collective (the host engine's stage dispatch) and whether collectives
overlap compute at all (not on the ``xla`` engine on CPU, where the simulator runs one
shared stream). The fastest prediction wins; ties go to the earlier candidate. The choice
is made once per traced step and is reported in ``strategy.last_choice`` (simulated
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
    ValueError: strategy='auto' candidates: 'nope' is not a registered strategy (registered: allreduce, wfbp, dear, approx, kfac, auto, diloco)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jaxsched.collectives.base import Collective
from jaxsched.costmodel import WFBP_PATTERN
from jaxsched.plan.compiled import compiled_estimates_apply
from jaxsched.strategies.base import Strategy
from jaxsched.strategies.registry import make_strategy, register_strategy, strategy_names


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
    """

    chosen: str
    simulated_s: dict
    overlaps: bool
    per_collective_s: float
    buckets: Any
    estimated_s: dict = dataclasses.field(default_factory=dict)


@register_strategy
class Auto(Strategy):
    """Chooses among exact strategies by simulating the step on the measured machine."""

    name = "auto"
    cost = WFBP_PATTERN  # never planned against: resolve() hands over to the chosen strategy

    def __init__(self, collective: Collective | None = None,
                 candidates: Sequence[str] = ("allreduce", "wfbp", "dear")):
        super().__init__(collective)
        self._given_collective = collective
        candidates = tuple(candidates)
        if not candidates:
            raise ValueError("strategy='auto' needs at least one candidate strategy")
        for name in candidates:
            if name == self.name or name not in strategy_names():
                raise ValueError(f"strategy='auto' candidates: {name!r} is not a registered "
                                 f"strategy (registered: {', '.join(strategy_names())})")
        self.candidates = candidates
        self.last_choice: AutoChoice | None = None

    def _candidates(self) -> list[Strategy]:
        built = []
        for name in self.candidates:
            try:
                built.append(make_strategy(name, collective=self._given_collective))
            except ValueError:  # e.g. allreduce cannot carry a compressor: not a candidate
                continue
        if not built:
            raise ValueError(f"no candidate of strategy='auto' ({', '.join(self.candidates)}) "
                             f"accepts collective {type(self._given_collective).__name__}")
        return built

    def resolve(self, captured: Any, buckets: Any, plan_options: dict, engine: Any
                ) -> tuple[Strategy, Any]:
        from jaxsched.plan import plan_buckets
        from jaxsched.plan.from_step import (group_paths, step_layer_profile,
                                             step_network_profile, with_selection_cost)
        from jaxsched.planned_step import PlannedStep
        from jaxsched.program import simulated_compression
        from jaxsched.sim import simulate

        if compiled_estimates_apply(captured.mesh.devices.flat[0].platform):
            return self._resolve_by_compiling(captured, buckets, plan_options, engine)
        probe = PlannedStep(captured, buckets, plan_options)
        costs = engine.costs(captured.mesh)
        layers, members = step_layer_profile(probe.analysis, probe.paths,
                                             plan_options.get("layer_profile"))
        network = step_network_profile(probe.analysis, plan_options.get("network_profile"), costs)
        layer_of = {i: k for k, group in enumerate(members) for i in group}
        results: dict[str, tuple[float, Strategy, Any]] = {}
        for candidate in self._candidates():
            compression = with_selection_cost(simulated_compression(candidate),
                                              candidate.collective, captured.mesh)
            if buckets is None or buckets == "auto":
                groups = plan_buckets(layers, network, plan_options.get("planner", "optimal"),
                                      strategy=candidate.cost, compression=compression)
                option = group_paths(groups, members, probe.paths)
            else:
                option = buckets
                planned = PlannedStep(captured, buckets, plan_options, candidate.cost)
                groups = _layer_groups([b.params for b in planned.buckets], layer_of)
            sim = simulate(layers, network, candidate.cost, groups, compression=compression,
                           shared_stream=not costs.overlaps, keep_spans=False)
            results[candidate.name] = (float(sim.iteration_s), candidate, option)
        chosen = min(results, key=lambda n: results[n][0])  # dicts keep order: ties go first
        _, strategy, option = results[chosen]
        self.last_choice = AutoChoice(chosen, {n: r[0] for n, r in results.items()},
                                      costs.overlaps, costs.per_collective_s, option)
        return strategy, option

    def _resolve_by_compiling(self, captured: Any, buckets: Any, plan_options: dict, engine: Any
                              ) -> tuple[Strategy, Any]:
        """On GPU/TPU: every candidate (and, with ``buckets`` None or ``"auto"``, each bucket
        option and all-reduce form of :func:`~jaxsched.plan.compiled.candidates_for`) compiled
        for the mesh;
        XLA's smallest estimated step wins. ``allreduce`` is the user's step as XLA compiles it
        alone, so the choice is never estimated slower than it."""
        from jaxsched.plan.compiled import candidates_for, choose_by_compiling

        platform = captured.mesh.devices.flat[0].platform
        pairs = [pair for candidate in self._candidates()
                 for pair in candidates_for(candidate, platform, buckets, mesh=captured.mesh)]
        choice = choose_by_compiling(captured, pairs, engine, plan_options)
        strategy, option = pairs[choice.chosen]
        self.last_choice = AutoChoice(strategy.name, {}, True, 0.0, option, choice.as_dict())
        return strategy, option

    # Until resolve() runs, the state is the user's trees; afterwards the chosen strategy's
    # program does all of the following.
    def convert(self, planned, state):
        raise RuntimeError("strategy='auto' converts through the strategy it chose")

    def finalize(self, planned, state):
        raise RuntimeError("strategy='auto' finalizes through the strategy it chose")

    def rewrite(self, planned):
        raise RuntimeError("strategy='auto' rewrites through the strategy it chose")


def _layer_groups(buckets: Sequence[Sequence[int]], layer_of: dict[int, int]) -> list[list[int]]:
    """Bucket plan over parameter leaves -> the simulator's groups of layers: contiguous runs
    in forward order of layers in the same bucket.

    A layer whose leaves sit in several buckets counts in the one its first leaf is in; a
    layer in no bucket (no reduced gradient) joins its predecessor's run.
    """
    owner: dict[int, int] = {}
    for b, params in enumerate(buckets):
        for i in params:
            owner.setdefault(layer_of[i], b)
    groups: list[list[int]] = []
    previous = None
    for layer in range(max(layer_of.values()) + 1):
        bucket = owner.get(layer, previous)
        if groups and bucket == previous:
            groups[-1].append(layer)
        else:
            groups.append([layer])
        previous = bucket
    return groups
