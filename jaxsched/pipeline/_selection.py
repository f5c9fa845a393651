"""Selection: the one place where the strategy, the buckets and the compiled choice are made.

Everything a program is built from is decided here, before the program is: which strategy
runs (``strategy="auto"`` picks one), which collective it sends through on this mesh, and
which buckets (``buckets="auto"`` plans them against the simulator on CPU, or by compiling
candidates and reading XLA's estimate on GPU and TPU). The result is a frozen
`PlannedStep` and the strategy that will rewrite it;
nothing downstream plans again.

Example:
    >>> import jax, optax
    >>> from jaxsched.zoo import models
    >>> from jaxsched.demo import steps
    >>> from jaxsched.core._capture import capture
    >>> from jaxsched.runtime.engine import make_engine
    >>> from jaxsched.strategies import make_strategy
    >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.sgd(0.1)
    >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
    >>> captured = capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
    >>> chosen = select(captured, make_strategy("wfbp"), [["head/bias", "head/kernel"],
    ...                 ["hidden/0/bias", "hidden/0/kernel"]], make_engine("xla"))
    >>> chosen.strategy.name, len(chosen.planned.buckets)
    ('wfbp', 2)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, TypeAlias

from jaxsched._errors import JaxschedValueError
from jaxsched.core._capture import CapturedStep
from jaxsched.plan import plan_buckets
from jaxsched.plan._from_step import (
    auto_bucket_paths,
    group_paths,
    step_layer_profile,
    step_network_profile,
    with_selection_cost,
)
from jaxsched.plan._planned_step import PlannedStep
from jaxsched.pipeline._program import Program
from jaxsched.runtime.engine._base import Engine
from jaxsched.pipeline._compiled_planner import (
    CompiledChoice,
    candidates_for,
    choose_by_compiling,
    compiled_estimates_apply,
)
from jaxsched.sim import Compression, simulate
from jaxsched.sim._costmodel import CommPattern, fsdp_pattern
from jaxsched.strategies._auto import Auto, AutoChoice
from jaxsched.strategies._base import Strategy

__all__ = [
    "BucketOption",
    "Selection",
    "build_program",
    "program_of",
    "select",
    "simulated_compression",
    "step_pattern",
]


#: ``schedule(buckets=...)``: None (the 25 MB threshold), a byte threshold, ``"auto"``
#: (planned), or an explicit plan (lists of parameter paths or subtree prefixes)
BucketOption: TypeAlias = int | str | Sequence[Sequence[str]] | None


@dataclasses.dataclass(frozen=True)
class Selection:
    """What will run.

    Attributes:
      strategy: the strategy that rewrites the step (``auto`` resolved, the mesh's
        collective chosen).
      planned: the captured step with its buckets, frozen.
      choice: ``strategy="auto"``'s choice (None for a concrete strategy).
      bucket_choice: with ``buckets="auto"`` on GPU or TPU, what each compiled candidate
        was estimated at (a `CompiledChoice`; None otherwise).

    Example:
      >>> from jaxsched.pipeline import _selection as selection
      >>> from jaxsched.strategies import make_strategy
      >>> chosen = selection.Selection(make_strategy("wfbp"), planned=None)
      >>> chosen.strategy.name, chosen.choice
      ('wfbp', None)
    """

    strategy: Strategy
    planned: PlannedStep
    choice: AutoChoice | None = None
    bucket_choice: CompiledChoice | None = None


def select(
    captured: CapturedStep, strategy: Strategy, buckets: BucketOption, engine: Engine, plan_options: dict | None = None
) -> Selection:
    """Resolve ``strategy`` and ``buckets`` for ``captured`` on ``engine``.

    Nothing given is changed: ``strategy="auto"``'s choice is returned as
    ``Selection.choice`` and the compiled candidates of ``buckets="auto"`` on GPU or TPU
    as ``Selection.bucket_choice`` (`jaxsched.Scheduled` shows them as
    ``sched.strategy.last_choice`` and ``sched.strategy.last_bucket_choice``).

    Args:
      captured: the user's step, traced once.
      strategy: a concrete strategy, or `jaxsched.strategies.Auto` to pick one.
      buckets: the bucket option (`BucketOption`): None, a byte threshold, ``"auto"`` or
        an explicit plan.
      engine: what runs the program; its costs enter the plan.
      plan_options: the planner's options (``schedule(plan_options=...)``).

    Returns:
      The `Selection`: the strategy for this mesh and the frozen plan.

    Raises:
      JaxschedValueError: ``buckets`` is a string other than ``"auto"``.

    Example:
      >>> import jax, optax
      >>> from jaxsched.core import _capture as capture
      >>> from jaxsched.demo import steps
      >>> from jaxsched.pipeline import _selection as selection
      >>> from jaxsched.runtime import engine
      >>> from jaxsched.strategies import make_strategy
      >>> from jaxsched.zoo import models
      >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> tx = optax.sgd(0.1)
      >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
      >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
      >>> chosen = selection.select(captured, make_strategy("wfbp"), None, engine.make_engine("xla"))
      >>> chosen.strategy.name, len(chosen.planned.buckets)  # buckets=None: the 25 MB threshold
      ('wfbp', 1)
    """
    plan_options = dict(plan_options or {})
    platform = captured.mesh.devices.flat[0].platform
    choice: AutoChoice | None = None
    bucket_choice: CompiledChoice | None = None
    if isinstance(strategy, Auto):
        strategy, buckets, choice = _choose_strategy(strategy, captured, buckets, plan_options, engine)
    elif _is_auto(buckets) and compiled_estimates_apply(platform) and not plan_options:
        pairs = candidates_for(strategy, platform, buckets, mesh=captured.mesh)
        bucket_choice = choose_by_compiling(captured, pairs, engine, plan_options, _build_planned)
        strategy, buckets = pairs[bucket_choice.chosen]
    strategy = strategy.for_mesh(captured)
    planned = _build_planned(captured, strategy, buckets, engine, plan_options)
    return Selection(strategy, planned, choice, bucket_choice)


def build_program(
    captured: CapturedStep, strategy: Strategy, buckets: BucketOption, engine: Engine, plan_options: dict | None = None
) -> Program:
    """The program of ``strategy`` for ``captured`` with bucket option ``buckets`` on
    ``engine``: a pure function of the four (and the planning options), so that a program
    can be cached by them (re-planning switches between cached programs).

    Args:
      captured: the user's step, traced once.
      strategy: the strategy (`Auto` resolved here).
      buckets: the bucket option (`BucketOption`).
      engine: what runs the program.
      plan_options: the planner's options.

    Returns:
      The `Program`: `select`, then `program_of`.

    Example:
      >>> import jax, optax
      >>> from jaxsched.core import _capture as capture
      >>> from jaxsched.demo import steps
      >>> from jaxsched.pipeline import _selection as selection
      >>> from jaxsched.runtime import engine
      >>> from jaxsched.strategies import make_strategy
      >>> from jaxsched.zoo import models
      >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> tx = optax.sgd(0.1)
      >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
      >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
      >>> program = selection.build_program(captured, make_strategy("dear"), None, engine.make_engine("xla"))
      >>> program.strategy.name, len(program.buckets)
      ('dear', 1)
    """
    return program_of(select(captured, strategy, buckets, engine, plan_options), engine)


def program_of(chosen: Selection, engine: Engine) -> Program:
    """The program of a `Selection` on ``engine``.

    Args:
      chosen: what `select` returned.
      engine: what runs it.

    Returns:
      The `Program` (built, not yet compiled).

    Example:
      >>> import jax, optax
      >>> from jaxsched.core import _capture as capture
      >>> from jaxsched.demo import steps
      >>> from jaxsched.pipeline import _selection as selection
      >>> from jaxsched.runtime import engine
      >>> from jaxsched.strategies import make_strategy
      >>> from jaxsched.zoo import models
      >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> tx = optax.sgd(0.1)
      >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
      >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
      >>> xla = engine.make_engine("xla")
      >>> chosen = selection.select(captured, make_strategy("wfbp"), None, xla)
      >>> selection.program_of(chosen, xla).planned is chosen.planned
      True
    """
    return Program(chosen.planned, chosen.strategy, engine)


def simulated_compression(strategy: Strategy) -> Compression | None:
    """The strategy's compressor as the planner's simulator models it, so that buckets are
    planned for the bytes the compressor really sends.

    Args:
      strategy: a concrete strategy.

    Returns:
      The simulator's `jaxsched.sim.Compression`, or None: dense, or a compressor or
      pattern the simulator does not model.

    Example:
      >>> from jaxsched.pipeline import _selection as selection
      >>> from jaxsched.runtime.compress import TopK
      >>> from jaxsched.strategies import make_strategy
      >>> selection.simulated_compression(make_strategy("wfbp")) is None  # dense
      True
      >>> selection.simulated_compression(make_strategy("wfbp", collective=TopK(0.01))).kind
      'topk'
    """
    model = getattr(strategy.collective, "sim_compression", None)
    if model is None or not strategy.cost.compressible:
        return None
    try:
        return model()
    except ValueError:  # e.g. one density per bucket (LAGS): the simulator models one
        return None


def _is_auto(buckets: object) -> bool:
    return isinstance(buckets, str) and buckets == "auto"


def step_pattern(captured: CapturedStep, pattern: CommPattern) -> CommPattern:
    """What a strategy of ``pattern`` sends on ``captured``: on a step whose parameters are
    sharded over the data axes (FSDP), each layer's gathers and its reduce-scatters
    (`jaxsched.sim._costmodel.fsdp_pattern`).

    Args:
      captured: the user's step.
      pattern: the strategy's pattern (``strategy.cost``).

    Returns:
      ``pattern``, or its FSDP form where the step's parameters are sharded over the data axes.

    Example:
      >>> import jax, optax
      >>> from jaxsched.core import _capture as capture
      >>> from jaxsched.demo import steps
      >>> from jaxsched.pipeline import _selection as selection
      >>> from jaxsched.runtime import engine
      >>> from jaxsched.strategies import make_strategy
      >>> from jaxsched.zoo import models
      >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> tx = optax.sgd(0.1)
      >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
      >>> captured = capture.capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
      >>> pattern = make_strategy("wfbp").cost
      >>> selection.step_pattern(captured, pattern) == pattern  # replicated parameters: unchanged
      True
    """
    from jaxsched.core._axes import as_axes, spec_axes

    data = set(as_axes(captured.axis_name))
    blocks = any(
        src.role == "params" and set(spec_axes(spec)) & data and captured.kind == "jit"
        for src, spec in zip(captured.sources, captured.in_specs)
    )
    return fsdp_pattern(pattern) if blocks else pattern


def _build_planned(
    captured: CapturedStep, strategy: Strategy, buckets: BucketOption, engine: Engine | None, plan_options: dict
) -> PlannedStep:
    """The frozen plan of a concrete strategy: ``buckets="auto"`` planned here, once."""
    pattern = step_pattern(captured, strategy.cost)
    compression = simulated_compression(strategy) if pattern.gathers_ahead is None else None
    layer_profile = network_profile = None
    if isinstance(buckets, str):
        if buckets != "auto":
            raise JaxschedValueError(
                f"buckets={buckets!r} is not understood; the only named plan is 'auto' (cost-model planning)"
            )
        probe = PlannedStep(captured)
        compression = with_selection_cost(
            compression, strategy.collective if compression is not None else None, captured.mesh
        )
        buckets, layer_profile, network_profile = auto_bucket_paths(
            probe.analysis,
            probe.paths,
            pattern,
            compression=compression,
            engine_costs=None if engine is None else engine.costs(captured.mesh),
            **plan_options,
        )
    return PlannedStep(
        captured,
        buckets,
        plan_options,
        pattern,
        compression=compression,
        engine=engine,
        layer_profile=layer_profile,
        network_profile=network_profile,
    )


def _choose_strategy(
    auto: Auto, captured: CapturedStep, buckets: BucketOption, plan_options: dict, engine: Engine
) -> tuple[Strategy, BucketOption, AutoChoice]:
    """``auto``'s choice: by XLA's estimate on GPU/TPU, else by the simulator."""
    platform = captured.mesh.devices.flat[0].platform
    if compiled_estimates_apply(platform):
        # every candidate (and, with buckets None or "auto", each bucket option and
        # all-reduce form) compiled for the mesh; allreduce is the user's step as XLA
        # compiles it alone, so the choice is never estimated slower than it
        pairs = [
            pair
            for candidate in auto.candidate_strategies()
            for pair in candidates_for(candidate, platform, buckets, mesh=captured.mesh)
        ]
        choice = choose_by_compiling(captured, pairs, engine, plan_options, _build_planned)
        strategy, option = pairs[choice.chosen]
        return strategy, option, AutoChoice(strategy.name, {}, True, 0.0, option, choice.as_dict())
    probe = PlannedStep(captured, None if _is_auto(buckets) else buckets, plan_options)
    costs = engine.costs(captured.mesh)
    layers, members = step_layer_profile(probe.analysis, probe.paths, plan_options.get("layer_profile"))
    network = step_network_profile(probe.analysis, plan_options.get("network_profile"), costs)
    layer_of = {i: k for k, group in enumerate(members) for i in group}
    results: dict[str, tuple[float, Strategy, BucketOption]] = {}
    for candidate in auto.candidate_strategies():
        compression = with_selection_cost(simulated_compression(candidate), candidate.collective, captured.mesh)
        pattern = step_pattern(captured, candidate.cost)
        if pattern.gathers_ahead is not None:
            compression = None  # FSDP's reduce-scatters carry no compressor
        if buckets is None or _is_auto(buckets):
            groups = plan_buckets(
                layers,
                network,
                plan_options.get("planner", "optimal"),
                strategy=pattern,
                compression=compression,
            )
            option = group_paths(groups, members, probe.paths)
        else:
            option = buckets
            groups = _layer_groups([b.params for b in probe.buckets], layer_of)
        sim = simulate(
            layers,
            network,
            pattern,
            groups,
            compression=compression,
            shared_stream=not costs.overlaps,
            keep_spans=False,
        )
        results[candidate.name] = (float(sim.iteration_s), candidate, option)
    chosen = min(results, key=lambda n: results[n][0])  # dicts keep order: ties go first
    _, strategy, option = results[chosen]
    made = AutoChoice(chosen, {n: r[0] for n, r in results.items()}, costs.overlaps, costs.per_collective_s, option)
    return strategy, option, made


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
