"""Paths of before and where each module lives now: optax's deprecation table.

Two kinds of old path, both served by a module-level ``__getattr__`` that warns with a
`DeprecationWarning` naming the new path, and returns the one module object (loaded under one
name, so ``isinstance`` checks and monkeypatching see the same classes):

- ``jaxsched.<old>`` (`MOVED`), the flat layout of before the layers, served by
  ``jaxsched.__getattr__``;
- ``jaxsched.<package>.<module>`` (`PRIVATE`), a module made private (``_module.py``) whose
  public names its package re-exports, served by each package's ``__getattr__`` through
  `moved_module`.

``import`` statements on old paths do not resolve: they must name the new path.

Example:
    >>> import warnings
    >>> import jaxsched
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     costmodel = jaxsched.sim.costmodel
    >>> costmodel is jaxsched.sim._costmodel
    True
    >>> str(caught[0].message).split(" (")[0]
    'jaxsched.sim.costmodel is deprecated: use jaxsched.sim, which exports its public names'
"""

import importlib
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "PRIVATE", "REMOVED_IN", "message", "moved_module", "public_home"]


#: the release that drops the old paths
REMOVED_IN = "0.2.0"

#: old attribute of ``jaxsched`` -> the module's path now. Not here: ``compress``, ``kfac`` and
#: ``nnx`` (public attributes), and ``inspect``, ``profile`` and ``optax`` (named like another
#: library; they are ``jaxsched.check._inspection``, ``jaxsched.plan._profiling`` and
#: ``jaxsched.strategies._approximation``).
MOVED: dict[str, str] = {
    "costmodel": "jaxsched.sim._costmodel",
    "zoo_profiles": "jaxsched.sim._zoo_profiles",
    "placement": "jaxsched.sim._kfac_placement",
    "intervals": "jaxsched.sim._intervals",
    "axes": "jaxsched.core._axes",
    "primitives": "jaxsched.core._primitives",
    "replay": "jaxsched.core._replay",
    "capture": "jaxsched.core._capture",
    "analyze": "jaxsched.core._analyze",
    "layout": "jaxsched.core._layout",
    "bucketing": "jaxsched.core._bucketing",
    "partition": "jaxsched.core.partition",
    "rewrite": "jaxsched.core.rewrite",
    "progress": "jaxsched.core._progress",
    "engine": "jaxsched.runtime.engine",
    "collectives": "jaxsched.runtime.collectives",
    "kernels": "jaxsched.runtime.kernels",
    "models": "jaxsched.zoo.models",
    "data": "jaxsched.zoo.data",
    "planned_step": "jaxsched.plan._planned_step",
    "program": "jaxsched.pipeline._program",
    "state_step": "jaxsched.pipeline._state_step",
    "verify": "jaxsched.check._verify",
    "checkpoint": "jaxsched.integrations.checkpoint",
    "steps": "jaxsched.demo.steps",
    "trainer": "jaxsched.demo.trainer",
    "config": "jaxsched.demo.config",
    "bench": "jaxsched.tools.bench",
    "cluster": "jaxsched.tools.cluster",
    "launch": "jaxsched.tools.launch",
    "aot": "jaxsched.tools.aot",
    "cli": "jaxsched.tools.cli",
}


#: packages whose ``__init__`` re-exports every public name of their private modules
EXPORTING = frozenset(
    (
        "jaxsched.check",
        "jaxsched.pipeline.replan",
        "jaxsched.plan",
        "jaxsched.runtime.collectives",
        "jaxsched.runtime.compress",
        "jaxsched.runtime.engine",
        "jaxsched.runtime.kernels",
        "jaxsched.sim",
        "jaxsched.strategies",
        "jaxsched.tools.aot",
    )
)

#: a module's public path before it was made private -> its private path now
PRIVATE: dict[str, str] = {
    "jaxsched.check.compiled_report": "jaxsched.check._compiled_report",
    "jaxsched.check.compiling": "jaxsched.check._compiling",
    "jaxsched.check.estimate": "jaxsched.check._estimate",
    "jaxsched.check.inspection": "jaxsched.check._inspection",
    "jaxsched.check.report": "jaxsched.check._report",
    "jaxsched.check.table": "jaxsched.check._table",
    "jaxsched.check.timeline": "jaxsched.check._timeline",
    "jaxsched.check.verify": "jaxsched.check._verify",
    "jaxsched.core.analyze": "jaxsched.core._analyze",
    "jaxsched.core.axes": "jaxsched.core._axes",
    "jaxsched.core.bucketing": "jaxsched.core._bucketing",
    "jaxsched.core.capture": "jaxsched.core._capture",
    "jaxsched.core.describe": "jaxsched.core._describe",
    "jaxsched.core.layout": "jaxsched.core._layout",
    "jaxsched.core.partition.blocks": "jaxsched.core.partition._blocks",
    "jaxsched.core.partition.control_flow": "jaxsched.core.partition._control_flow",
    "jaxsched.core.partition.forward_rules": "jaxsched.core.partition._forward_rules",
    "jaxsched.core.partition.interpreter": "jaxsched.core.partition._interpreter",
    "jaxsched.core.partition.kinds": "jaxsched.core.partition._kinds",
    "jaxsched.core.partition.narrowing_rules": "jaxsched.core.partition._narrowing_rules",
    "jaxsched.core.partition.placement": "jaxsched.core.partition._placement",
    "jaxsched.core.partition.rules": "jaxsched.core.partition._rules",
    "jaxsched.core.partition.table": "jaxsched.core.partition._table",
    "jaxsched.core.primitives": "jaxsched.core._primitives",
    "jaxsched.core.progress": "jaxsched.core._progress",
    "jaxsched.core.replay": "jaxsched.core._replay",
    "jaxsched.core.rewrite.backward": "jaxsched.core.rewrite._backward",
    "jaxsched.core.rewrite.layers": "jaxsched.core.rewrite._layers",
    "jaxsched.core.rewrite.pending_sums": "jaxsched.core.rewrite._pending_sums",
    "jaxsched.core.rewrite.rules": "jaxsched.core.rewrite._rules",
    "jaxsched.core.static_leaves": "jaxsched.core._static_leaves",
    "jaxsched.pipeline.compiled_planner": "jaxsched.pipeline._compiled_planner",
    "jaxsched.pipeline.program": "jaxsched.pipeline._program",
    "jaxsched.pipeline.replan.agreement": "jaxsched.pipeline.replan._agreement",
    "jaxsched.pipeline.replan.estimate": "jaxsched.pipeline.replan._estimate",
    "jaxsched.pipeline.replan.monitor": "jaxsched.pipeline.replan._monitor",
    "jaxsched.pipeline.replan.options": "jaxsched.pipeline.replan._options",
    "jaxsched.pipeline.replan.replanner": "jaxsched.pipeline.replan._replanner",
    "jaxsched.pipeline.selection": "jaxsched.pipeline._selection",
    "jaxsched.pipeline.state_step": "jaxsched.pipeline._state_step",
    "jaxsched.plan.from_step": "jaxsched.plan._from_step",
    "jaxsched.plan.mgwfbp": "jaxsched.plan._mgwfbp",
    "jaxsched.plan.optimal": "jaxsched.plan._optimal",
    "jaxsched.plan.per_layer": "jaxsched.plan._per_layer",
    "jaxsched.plan.planned_step": "jaxsched.plan._planned_step",
    "jaxsched.plan.profiling": "jaxsched.plan._profiling",
    "jaxsched.plan.prophet": "jaxsched.plan._prophet",
    "jaxsched.plan.threshold": "jaxsched.plan._threshold",
    "jaxsched.runtime.collectives.base": "jaxsched.runtime.collectives._base",
    "jaxsched.runtime.collectives.hierarchical": "jaxsched.runtime.collectives._hierarchical",
    "jaxsched.runtime.collectives.torus": "jaxsched.runtime.collectives._torus",
    "jaxsched.runtime.compress.base": "jaxsched.runtime.compress._base",
    "jaxsched.runtime.compress.cast": "jaxsched.runtime.compress._cast",
    "jaxsched.runtime.compress.dgc": "jaxsched.runtime.compress._dgc",
    "jaxsched.runtime.compress.gtopk": "jaxsched.runtime.compress._gtopk",
    "jaxsched.runtime.compress.powersgd": "jaxsched.runtime.compress._powersgd",
    "jaxsched.runtime.compress.quantize": "jaxsched.runtime.compress._quantize",
    "jaxsched.runtime.compress.topk": "jaxsched.runtime.compress._topk",
    "jaxsched.runtime.engine.auto": "jaxsched.runtime.engine._auto",
    "jaxsched.runtime.engine.base": "jaxsched.runtime.engine._base",
    "jaxsched.runtime.engine.host": "jaxsched.runtime.engine._host",
    "jaxsched.runtime.engine.xla": "jaxsched.runtime.engine._xla",
    "jaxsched.runtime.kernels.error_feedback": "jaxsched.runtime.kernels._error_feedback",
    "jaxsched.runtime.processes": "jaxsched.runtime._processes",
    "jaxsched.sim.closed_form": "jaxsched.sim._closed_form",
    "jaxsched.sim.core": "jaxsched.sim._core",
    "jaxsched.sim.costmodel": "jaxsched.sim._costmodel",
    "jaxsched.sim.diloco": "jaxsched.sim._diloco",
    "jaxsched.sim.intervals": "jaxsched.sim._intervals",
    "jaxsched.sim.kfac_placement": "jaxsched.sim._kfac_placement",
    "jaxsched.sim.timeline": "jaxsched.sim._timeline",
    "jaxsched.sim.zoo_profiles": "jaxsched.sim._zoo_profiles",
    "jaxsched.strategies.allreduce": "jaxsched.strategies._allreduce",
    "jaxsched.strategies.approx": "jaxsched.strategies._approx",
    "jaxsched.strategies.approximation": "jaxsched.strategies._approximation",
    "jaxsched.strategies.auto": "jaxsched.strategies._auto",
    "jaxsched.strategies.base": "jaxsched.strategies._base",
    "jaxsched.strategies.dear": "jaxsched.strategies._dear",
    "jaxsched.strategies.diloco": "jaxsched.strategies._diloco",
    "jaxsched.strategies.diloco_fragments": "jaxsched.strategies._diloco_fragments",
    "jaxsched.strategies.kfac": "jaxsched.strategies._kfac",
    "jaxsched.strategies.registry": "jaxsched.strategies._registry",
    "jaxsched.strategies.wfbp": "jaxsched.strategies._wfbp",
    "jaxsched.tools.aot.compare": "jaxsched.tools.aot._compare",
    "jaxsched.tools.aot.experiment": "jaxsched.tools.aot._experiment",
    "jaxsched.tools.bench_worker": "jaxsched.tools._bench_worker",
    "jaxsched.tools.calibration": "jaxsched.tools._calibration",
    "jaxsched.tools.cli.bench": "jaxsched.tools.cli._bench",
    "jaxsched.tools.cli.cluster": "jaxsched.tools.cli._cluster",
    "jaxsched.tools.cli.inspection": "jaxsched.tools.cli._inspection",
    "jaxsched.tools.cli.options": "jaxsched.tools.cli._options",
    "jaxsched.tools.cli.simulate": "jaxsched.tools.cli._simulate",
    "jaxsched.tools.cli.train": "jaxsched.tools.cli._train",
    "jaxsched.tools.cli.verify": "jaxsched.tools.cli._verify",
}


def public_home(module: str) -> str | None:
    """The package that re-exports the public names of ``module`` (a private path), or None
    for an internal module, whose names users need (if any) are in ``jaxsched`` itself."""
    package = module.rpartition(".")[0]
    return package if package in EXPORTING else None


def _private_message(old: str, new: str) -> str:
    home = public_home(new)
    if home is None:
        return (
            f"{old} is deprecated: it is internal now ({new}), and what users need of it is in jaxsched "
            f"(the old path goes in jaxsched {REMOVED_IN})"
        )
    return (
        f"{old} is deprecated: use {home}, which exports its public names (the module is private now, "
        f"{new}; the old path goes in jaxsched {REMOVED_IN})"
    )


def message(name: str) -> str:
    """The warning for ``jaxsched.<name>``, a key of `MOVED`."""
    new = MOVED[name]
    if new.rpartition(".")[2].startswith("_"):
        return _private_message(f"jaxsched.{name}", new)
    return f"jaxsched.{name} is deprecated: use {new} (the old path goes in jaxsched {REMOVED_IN})"


def moved_module(package: str, name: str) -> ModuleType:
    """``package.name`` for a module made private: warns and returns it, else AttributeError.

    A package's ``__getattr__`` is ``return moved_module(__name__, name)``. ``from package
    import name`` asks twice, first from the import machinery: that ask does not warn.
    """
    old = f"{package}.{name}"
    if old not in PRIVATE:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    new = PRIVATE[old]
    if not sys._getframe(2).f_code.co_filename.startswith("<frozen importlib"):
        warnings.warn(_private_message(old, new), DeprecationWarning, stacklevel=3)
    return importlib.import_module(new)
