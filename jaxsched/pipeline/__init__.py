"""From a captured step to a runnable program.

`selection` resolves the strategy, the buckets and the compile-and-choose
planner in one place; `PlannedStep` is the frozen
result; `program` builds and caches the program per abstract input
signature; `state_step` adapts the step forms users write.
"""

from jaxsched import _deprecations

__all__: list[str] = []


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
