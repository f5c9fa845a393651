"""Reading and rewriting a step, knowing no strategy.

The transform's lowest layer: `capture` traces the user's step to a
per-device jaxpr (`partition` first turns a ``jax.jit`` step on global
arrays into one), `analyze` finds where each parameter is used and its
gradient completed, `bucketing` and `layout` pack
gradients into buckets, and `rewrite` holds the rules that move
collectives. Nothing here imports a strategy, a planner or an engine.
"""

from jaxsched import _deprecations

__all__: list[str] = []


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
