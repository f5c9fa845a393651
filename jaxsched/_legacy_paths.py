"""Import paths from before the layered layout, kept so that user code keeps importing.

``import jaxsched.optax`` or ``from jaxsched.costmodel import network_preset`` resolve to the
module's new home (``jaxsched.strategies.approximation``, ``jaxsched.sim.costmodel``): the
module object is the same, so ``isinstance`` checks and monkeypatching see one module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

__all__ = ["MOVED", "install"]

MOVED: dict[str, str] = {
    "jaxsched.costmodel": "jaxsched.sim.costmodel",
    "jaxsched.zoo_profiles": "jaxsched.sim.zoo_profiles",
    "jaxsched.placement": "jaxsched.sim.kfac_placement",
    "jaxsched.intervals": "jaxsched.sim.intervals",
    "jaxsched.axes": "jaxsched.core.axes",
    "jaxsched.primitives": "jaxsched.core.primitives",
    "jaxsched.replay": "jaxsched.core.replay",
    "jaxsched.capture": "jaxsched.core.capture",
    "jaxsched.analyze": "jaxsched.core.analyze",
    "jaxsched.layout": "jaxsched.core.layout",
    "jaxsched.bucketing": "jaxsched.core.bucketing",
    "jaxsched.partition": "jaxsched.core.partition",
    "jaxsched.rewrite": "jaxsched.core.rewrite",
    "jaxsched.progress": "jaxsched.core.progress",
    "jaxsched.engine": "jaxsched.runtime.engine",
    "jaxsched.collectives": "jaxsched.runtime.collectives",
    "jaxsched.compress": "jaxsched.runtime.compress",
    "jaxsched.kernels": "jaxsched.runtime.kernels",
    "jaxsched.models": "jaxsched.zoo.models",
    "jaxsched.data": "jaxsched.zoo.data",
    "jaxsched.profile": "jaxsched.plan.profiling",
    "jaxsched.plan.compiled": "jaxsched.pipeline.compiled_planner",
    "jaxsched.planned_step": "jaxsched.plan.planned_step",
    "jaxsched.program": "jaxsched.pipeline.program",
    "jaxsched.state_step": "jaxsched.pipeline.state_step",
    "jaxsched.verify": "jaxsched.check.verify",
    "jaxsched.inspect": "jaxsched.check.inspection",
    "jaxsched.optax": "jaxsched.strategies.approximation",
    "jaxsched.nnx": "jaxsched.integrations.nnx",
    "jaxsched.kfac": "jaxsched.integrations.kfac",
    "jaxsched.checkpoint": "jaxsched.integrations.checkpoint",
    "jaxsched.steps": "jaxsched.demo.steps",
    "jaxsched.trainer": "jaxsched.demo.trainer",
    "jaxsched.config": "jaxsched.demo.config",
    "jaxsched.bench": "jaxsched.tools.bench",
    "jaxsched.cluster": "jaxsched.tools.cluster",
    "jaxsched.launch": "jaxsched.tools.launch",
    "jaxsched.aot": "jaxsched.tools.aot",
    "jaxsched.cli": "jaxsched.tools.cli",
}


def _new_name(fullname: str) -> str | None:
    """The new home of ``fullname`` or of a submodule of a moved package."""
    for old, new in MOVED.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self._target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self._target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """The module ran under its own name; only give it back its own spec."""
        module.__spec__ = self._own_spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds only the names in `MOVED` (and their submodules); defers everything else."""

    def find_spec(self, fullname, path=None, target=None):
        new = _new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Register the finder once per interpreter (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
