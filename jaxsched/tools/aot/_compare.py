"""Every strategy compiled for one target, beside the user's step as XLA compiles it alone.

Why: on GPU, XLA's latency-hiding scheduler already overlaps a plain step's all-reduces, so
a strategy is only worth running where the compiled program beats that. This module
compiles each strategy (and the plain step with XLA's default options) for the same
abstract step and reports XLA's estimates side by side: estimated step, exposed
communication, each as a ratio to the plain step's, and which collectives are async.

Example (on CPU devices XLA writes no estimate, so only the structure shows; use
``abstract_experiment(ZOO["mlp"], target="h100:1x2x4")`` with the ``aot`` extra):
    >>> import jax
    >>> from jaxsched.tools.aot._experiment import ModelSpec, abstract_experiment
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> exp = abstract_experiment(ModelSpec("mlp", (8,), 2, {"hidden": (4,)}), mesh=mesh)
    >>> comparison = compare_strategies(exp, ["wfbp"])
    >>> comparison.baseline.label, [r.label for r in comparison.reports]
    ('plain (XLA defaults)', ['wfbp'])
    >>> comparison.reports[0].collectives[0].kind, comparison.reports[0].step_s
    ('all-reduce', None)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

from jax.sharding import Mesh

from jaxsched.check import _inspection as inspect_lib

__all__ = ["Comparison", "Experiment", "compare_strategies"]


class Experiment(Protocol):
    """What `compare_strategies` compiles: a step and abstract (or real) inputs on a mesh,
    as `jaxsched.tools.aot._experiment.AbstractExperiment` holds them.

    Attributes:
      step: the user's step, ``step(params, opt_state, batch)``.
      params, opt_state, batch: the step's inputs (the user's pytrees, e.g. of
        ``jax.ShapeDtypeStruct`` with shardings).
      mesh: the devices the step runs on.
    """

    @property
    def step(self) -> Callable[..., Any]: ...
    @property
    def params(self) -> Any: ...
    @property
    def opt_state(self) -> Any: ...
    @property
    def batch(self) -> Any: ...
    @property
    def mesh(self) -> Mesh: ...


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Compiled reports of several strategies and of the plain step (XLA's defaults).

    Attributes:
      target: what was compiled for (``"h100:1x2x4"``).
      description: the model and batch.
      baseline: the plain step's report (XLA's default options).
      reports: one per strategy, in the order asked.
      reference: what ratios are taken against: the baseline, or, where XLA writes no
        schedule for it (XLA:TPU with default options runs every collective synchronously
        and writes no schedule; the baseline's estimate then comes from XLA's instruction
        costs, not comparable with a schedule's), the plain step compiled with the
        engine's options for the platform, labelled as such.
    """

    target: str
    description: str
    baseline: inspect_lib.CompiledReport
    reports: tuple[inspect_lib.CompiledReport, ...]
    reference: inspect_lib.CompiledReport | None = None

    @property
    def ratio_base(self) -> inspect_lib.CompiledReport:
        """The report ratios are taken against: ``reference``, else ``baseline``."""
        return self.reference if self.reference is not None else self.baseline

    def ratios(self, report: inspect_lib.CompiledReport) -> dict[str, float | None]:
        """``report``'s estimated step and exposed communication over the reference's."""
        return inspect_lib.ratios(report, self.ratio_base)

    def _all(self) -> tuple[inspect_lib.CompiledReport, ...]:
        return (self.baseline,) + ((self.reference,) if self.reference is not None else ()) + self.reports

    def table(self) -> str:
        """Every report as a text table (`jaxsched.check._table.format_table`), ratios to `ratio_base`."""
        return inspect_lib.format_table(self._all(), baseline=self.ratio_base)

    def plot(self, path: str) -> str:
        """Every report's timeline (`jaxsched.check._timeline.plot`) written to ``path``."""
        return inspect_lib.plot(self._all(), path)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "model": self.description,
            "estimator": self.baseline.estimator,
            "baseline": self.baseline.to_json(),
            "reference": self.ratio_base.label,
            "reference_report": None if self.reference is None else self.reference.to_json(),
            "strategies": {r.label: dict(r.to_json(), ratio_to_reference=self.ratios(r)) for r in self.reports},
        }


def compare_strategies(
    experiment: Experiment,
    strategies: Sequence[str],
    *,
    target: str = "",
    progress: bool = False,
    **schedule_options: Any,
) -> Comparison:
    """Compile ``experiment`` (an `AbstractExperiment` or
    anything with ``step``, ``params``, ``opt_state``, ``batch``, ``mesh``) under each
    strategy and the plain step; ``schedule_options`` go to `jaxsched.schedule`.

    Args:
      experiment: the step and its inputs.
      strategies: strategy names, compiled in this order.
      target: what the reports say they were compiled for (default: the mesh's devices).
      progress: print a line per strategy.
      **schedule_options: for `jaxsched.schedule` (``buckets=``, ``engine=`` ...).

    Returns:
      The `Comparison`.

    Example:
      The module's example runs it; on CPU XLA writes no estimate, so compare the structure:

      >>> import jax
      >>> from jaxsched.tools import aot
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> exp = aot.abstract_experiment(aot.ModelSpec("mlp", (8,), 2, {"hidden": (4,)}), mesh=mesh)
      >>> comparison = aot.compare_strategies(exp, ["allreduce"])
      >>> [r.num_sync for r in comparison.reports], comparison.baseline.num_sync  # XLA:CPU: all synchronous
      ([1], 1)
    """
    from jaxsched.core._progress import note, progress as progress_lines
    from jaxsched._schedule import schedule

    reports = []
    baseline = None
    names = progress_lines(list(strategies), f"compiling for {target or 'the mesh'}", enabled=progress)
    for k, name in enumerate(names, start=1):
        names.set_postfix(strategy=name)
        note(
            f"compiling {name} ({k}/{len(strategies)}) for {target or 'the mesh'}"
            + (" and the plain step" if baseline is None else "")
            + "...",
            enabled=progress,
        )
        sched = schedule(experiment.step, strategy=name, **schedule_options)
        state = sched.init(experiment.params, experiment.opt_state)
        inspection = sched.inspect(state, experiment.batch, baseline=baseline is None)
        baseline = baseline or inspection.baseline
        reports.append(dataclasses.replace(inspection.report, target=target or inspection.report.target))
    args = (experiment.params, experiment.opt_state, experiment.batch)
    if baseline is None:
        baseline = inspect_lib.inspect_jitted(experiment.step, args, experiment.mesh, label=inspect_lib.PLAIN_LABEL)
    baseline = dataclasses.replace(baseline, target=target or baseline.target)
    reference = None
    platform = experiment.mesh.devices.flat[0].platform
    if baseline.estimate_source != inspect_lib.ESTIMATE_FROM_SCHEDULE and platform != "cpu":
        from jaxsched.runtime.engine._xla import compiler_options_for

        reference = inspect_lib.inspect_jitted(
            experiment.step,
            args,
            experiment.mesh,
            label=f"plain (jaxsched's {platform} options)",
            compiler_options=compiler_options_for(platform),
        )
        reference = dataclasses.replace(reference, target=baseline.target)
    return Comparison(
        target or baseline.target, getattr(experiment, "description", ""), baseline, tuple(reports), reference
    )
