"""Reading and rewriting a step, knowing no strategy.

The transform's lowest layer: :mod:`~jaxsched.core.capture` traces the user's step to a
per-device jaxpr (:mod:`~jaxsched.core.partition` first turns a ``jax.jit`` step on global
arrays into one), :mod:`~jaxsched.core.analyze` finds where each parameter is used and its
gradient completed, :mod:`~jaxsched.core.bucketing` and :mod:`~jaxsched.core.layout` pack
gradients into buckets, and :mod:`~jaxsched.core.rewrite` holds the rules that move
collectives. Nothing here imports a strategy, a planner or an engine.
"""

__all__: list[str] = []
