"""Choosing by XLA's estimate: on GPU and TPU, compile each candidate and keep the fastest.

Why: on an accelerator the compiler decides what overlaps. XLA:GPU's latency-hiding
scheduler already overlaps the plain step's all-reduce on its own, and XLA:TPU merges or
keeps collectives depending on their shapes (docs/accelerators.md), so a simulator of an
idealized overlap cannot rank strategies there. The compiled program and the scheduler's
own estimate of it can, and compiling needs no accelerator (`jaxsched.tools.aot`).

A candidate is a (strategy, bucket option) pair. Each is built into a program, compiled
for the step's mesh, and read by `jaxsched.check._inspection`; the smallest estimated step
wins, ties to the earlier candidate. Where XLA writes a schedule for some candidates and not
for others (XLA:TPU writes none for a program without async collectives), all are judged by
XLA's instruction costs instead; a candidate with no estimate at all ranks last.

Example:
    >>> compiled_estimates_apply("gpu"), compiled_estimates_apply("cpu")
    (True, False)
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable, Sequence

from jax.sharding import Mesh

from jaxsched._errors import JaxschedValueError
from jaxsched.core._capture import CapturedStep
from jaxsched.pipeline._program import Program
from jaxsched.plan._planned_step import PlannedStep
from jaxsched.runtime.engine._base import Engine, platform_family
from jaxsched.strategies._base import Strategy

__all__ = [
    "BUCKET_CANDIDATES",
    "DEVICE_DCN_REDUCTION",
    "ONE_BUCKET",
    "VARIANTS",
    "CompiledChoice",
    "candidates_for",
    "choose_by_compiling",
    "compiled_estimates_apply",
    "spans_slices",
]

#: One bucket for every gradient in practice (1 GiB): on a multi-host GPU mesh each
#: collective pays a latency and XLA:GPU runs one at a time, so one large collective can
#: beat several (and approx's reduction, which can start at the top of the step, needs no
#: pipelining at all).
ONE_BUCKET = 2**30

#: Bucket options tried per platform for a strategy whose buckets are chosen on an
#: accelerator: the default 25 MB threshold; on GPU also `ONE_BUCKET` (smaller
#: buckets were always estimated slower there). On TPU every tensor travels on its own
#: (``per_tensor``), so the bucket size changes nothing XLA estimates (4 MB and 25 MB gave
#: identical estimates for every strategy on the zoo's MLP and CNN). See
#: docs/accelerators.md.
BUCKET_CANDIDATES: dict[str, tuple[Any, ...]] = {"gpu": (None, ONE_BUCKET), "tpu": (None,)}

#: Variants tried per platform besides the engine's own choices (``None``): ``"packed"``
#: sends every bucket operation as one packed buffer (XLA:GPU's estimator prices one large
#: collective far below several small ones); ``"xla defaults"`` compiles the rewritten
#: program with XLA's default options, whose combiner regroups the collectives (on GPU this
#: was the best for some models and the worst for others; on a two-slice TPU pod it lets
#: ``approx``'s cross-slice transfers span the step: the zoo CNN's estimated exposed
#: communication fell from 0.24x to 0.03x the plain step's); ``"device DCN reduction"``
#: (TPU pods of several slices only) sums the cross-slice shares on the TPUs rather than
#: in the hosts' megascale runtime (`DEVICE_DCN_REDUCTION`). Packed buffers stay
#: synchronous on TPU, so that variant is GPU only.
VARIANTS: dict[str, tuple[str | None, ...]] = {
    "gpu": (None, "packed", "xla defaults"),
    "tpu": (None, "xla defaults", "device DCN reduction"),
}

#: The options of the ``"device DCN reduction"`` variant. XLA:TPU otherwise hands each
#: cross-slice share to the megascale runtime as host send/recv pairs, whose receives it
#: schedules after backward; summed on the devices, the zoo Transformer's ``approx`` step
#: was estimated at 1.10x the plain step instead of 1.33x and the 126M-parameter MLP's
#: ``dear`` at 0.86x instead of 1.00x, while ``wfbp`` lost 3% to 4% (docs/accelerators.md).
DEVICE_DCN_REDUCTION: dict[str, Any] = {"xla_tpu_use_megascale_host_reduction": False}

#: Variants that only change a program whose mesh spans several TPU slices.
_MULTI_SLICE_VARIANTS = frozenset({"device DCN reduction"})


def spans_slices(mesh: Mesh | None) -> bool:
    """Whether ``mesh``'s devices sit in more than one TPU slice (joined over DCN)."""
    from jaxsched.core._axes import num_slices

    return mesh is not None and num_slices(mesh.devices.flat) > 1


def candidates_for(
    strategy: Strategy, platform: str, buckets: Any, *, mesh: Mesh | None = None
) -> list[tuple[Strategy, Any]]:
    """(strategy, buckets) pairs to compile: ``strategy`` as given and, for a plain
    collective, each variant of `VARIANTS` (those for several slices only when
    ``mesh`` spans several); each bucket option of `BUCKET_CANDIDATES` when
    ``buckets`` is None or ``"auto"``, else ``buckets``."""
    from jaxsched.runtime.collectives._base import OPERATIONS, Collective

    platform = platform_family(platform)
    if not strategy.accepts_collective:
        pairs = [(strategy, None)]
        if strategy.compiler_defaults and platform in VARIANTS:
            # the plain step (XLA's defaults) and the same step under the engine's options,
            # which alone may overlap as well as a schedule (an 8x1024 MLP on h100:1x2x4:
            # 624 us against wfbp's 630, XLA's estimates)
            pairs.append((_variant(strategy, compiler_defaults=False), None))
        return pairs
    options = BUCKET_CANDIDATES.get(platform, (None,)) if buckets is None or buckets == "auto" else (buckets,)
    variants = [strategy]
    if type(strategy.collective) is Collective and not strategy.collective.forms:
        for name in VARIANTS.get(platform, (None,)):
            if name is None or (name in _MULTI_SLICE_VARIANTS and not spans_slices(mesh)):
                continue
            if name == "packed":
                variant = _variant(strategy, collective=Collective(forms={op: "packed" for op in OPERATIONS}))
            elif name == "device DCN reduction":
                variant = _variant(strategy, compiler_overrides=dict(DEVICE_DCN_REDUCTION))
            else:
                variant = _variant(strategy, compiler_defaults=True)
            variants.append(variant)
    return [(v, b) for v in variants for b in options]


def _variant(strategy: Strategy, **options: Any) -> Strategy:
    """A copy of ``strategy`` (the same options otherwise) with ``options`` as its own
    values, over the class-level defaults (``compiler_defaults``, ``compiler_overrides``):
    the strategy given is never changed."""
    variant = copy.copy(strategy)
    for name, value in options.items():
        setattr(variant, name, value)
    return variant


def compiled_estimates_apply(platform: str) -> bool:
    """Whether choices on this platform go by the compiled estimate (GPU, TPU) rather than
    the simulator (CPU, where XLA runs collectives inline and writes no estimate)."""
    return platform_family(platform) in ("gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class CompiledChoice:
    """Attributes:
    chosen: index of the winning candidate.
    labels: one label per candidate (``"wfbp, buckets=1073741824"``).
    estimated_step_s: XLA's estimated step per candidate (None: no estimate).
    estimated_exposed_s: XLA's estimated exposed communication per candidate.
    """

    chosen: int
    labels: tuple[str, ...]
    estimated_step_s: tuple[float | None, ...]
    estimated_exposed_s: tuple[float | None, ...]

    def as_dict(self) -> dict[str, float | None]:
        return dict(zip(self.labels, self.estimated_step_s))


def choose_by_compiling(
    captured: CapturedStep,
    candidates: Sequence[tuple[Strategy, Any]],
    engine: Engine,
    plan_options: dict,
    plan: Callable[[CapturedStep, Strategy, Any, Engine, dict], PlannedStep],
) -> CompiledChoice:
    """Compile every ``(strategy, buckets)`` candidate for ``captured``'s mesh and return
    which XLA estimates fastest (see the module docstring). ``plan(captured, strategy,
    buckets, engine, plan_options)`` gives each candidate's planned step.

    Every candidate is judged by the same estimate: XLA's schedule where it wrote one for
    each, else XLA's instruction costs for all (a single TPU slice writes no schedule for a
    program without async collectives, the plain step's among them; ranked last, it could
    never be chosen where it is fastest)."""
    from jaxsched.check import _inspection as inspect_lib

    if captured.example_inputs is None:
        raise JaxschedValueError("the captured step carries no example inputs to compile with")
    params, opt_state, batch = captured.example_inputs
    labels, reports, compiled = [], [], []
    for strategy, buckets in candidates:
        strategy = strategy.for_mesh(captured)
        program = Program(plan(captured, strategy, buckets, engine, dict(plan_options)), strategy, engine)
        lowered = program.lower(strategy.initial_state(params, opt_state), batch)
        options = program.compiler_options
        binary, schedule = inspect_lib.compile_with_schedule(lowered, options)
        mesh = program.planned.mesh
        reports.append(inspect_lib.report(binary, schedule, mesh, label=strategy.name, compiler_options=options))
        compiled.append((binary, mesh))
        forms = sorted(set(strategy.collective.forms.values()))
        labels.append(
            f"{strategy.name}, buckets={buckets}"
            + "".join(f", {f}" for f in forms)
            + (", xla defaults" if strategy.compiler_defaults and strategy.name != "allreduce" else "")
            + (", engine options" if not strategy.compiler_defaults and strategy.name == "allreduce" else "")
            + (", device DCN reduction" if strategy.compiler_overrides == DEVICE_DCN_REDUCTION else "")
        )
    if any(r.step_s is None for r in reports) and any(r.step_s is not None for r in reports):
        by_costs = [
            inspect_lib.estimate_from_instruction_costs(dataclasses.replace(r, step_s=None), binary, mesh)
            for r, (binary, mesh) in zip(reports, compiled)
        ]
        if all(r.step_s is not None for r in by_costs):
            reports = by_costs
    steps = [r.step_s for r in reports]
    ranked = [s if s is not None else math.inf for s in steps]
    chosen = min(range(len(ranked)), key=lambda i: (ranked[i], i))
    return CompiledChoice(chosen, tuple(labels), tuple(steps), tuple(r.exposed_comm_s for r in reports))
