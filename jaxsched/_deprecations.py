"""Attribute paths from before the layered layout, and where each module lives now.

``jaxsched.<old>`` is looked up here by ``jaxsched.__getattr__``: it returns the module at
its new home (one module object under one name, so ``isinstance`` checks and monkeypatching
see the same classes) and warns with a `DeprecationWarning` that names the new path.
``import jaxsched.<old>`` statements do not resolve: they must name the new path.

Example:
    >>> import warnings
    >>> import jaxsched
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     costmodel = jaxsched.costmodel
    >>> costmodel is jaxsched.sim.costmodel
    True
    >>> print(caught[0].message)
    jaxsched.costmodel is deprecated: use jaxsched.sim.costmodel (the old path goes in jaxsched 0.2.0)
"""

__all__ = ["MOVED", "REMOVED_IN", "message"]

#: the release that drops the old paths
REMOVED_IN = "0.2.0"

#: old attribute of ``jaxsched`` -> the module's path now. Not here: ``compress``, ``kfac`` and
#: ``nnx`` (public attributes), and ``inspect``, ``profile`` and ``optax`` (named like another
#: library; they are ``jaxsched.check.inspection``, ``jaxsched.plan.profiling`` and
#: ``jaxsched.strategies.approximation``).
MOVED: dict[str, str] = {
    "costmodel": "jaxsched.sim.costmodel",
    "zoo_profiles": "jaxsched.sim.zoo_profiles",
    "placement": "jaxsched.sim.kfac_placement",
    "intervals": "jaxsched.sim.intervals",
    "axes": "jaxsched.core.axes",
    "primitives": "jaxsched.core.primitives",
    "replay": "jaxsched.core.replay",
    "capture": "jaxsched.core.capture",
    "analyze": "jaxsched.core.analyze",
    "layout": "jaxsched.core.layout",
    "bucketing": "jaxsched.core.bucketing",
    "partition": "jaxsched.core.partition",
    "rewrite": "jaxsched.core.rewrite",
    "progress": "jaxsched.core.progress",
    "engine": "jaxsched.runtime.engine",
    "collectives": "jaxsched.runtime.collectives",
    "kernels": "jaxsched.runtime.kernels",
    "models": "jaxsched.zoo.models",
    "data": "jaxsched.zoo.data",
    "planned_step": "jaxsched.plan.planned_step",
    "program": "jaxsched.pipeline.program",
    "state_step": "jaxsched.pipeline.state_step",
    "verify": "jaxsched.check.verify",
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


def message(name: str) -> str:
    """The warning for ``jaxsched.<name>``, a key of `MOVED`."""
    return f"jaxsched.{name} is deprecated: use {MOVED[name]} (the old path goes in jaxsched {REMOVED_IN})"
