"""From a captured step to a runnable program.

`selection` resolves the strategy, the buckets and the compile-and-choose
planner in one place; `PlannedStep` is the frozen
result; `program` builds and caches the program per abstract input
signature; `state_step` adapts the step forms users write.
"""

__all__: list[str] = []
