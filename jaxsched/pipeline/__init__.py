"""From a captured step to a runnable program.

:mod:`~jaxsched.pipeline.selection` resolves the strategy, the buckets and the compile-and-choose
planner in one place; :class:`~jaxsched.plan.planned_step.PlannedStep` is the frozen
result; :mod:`~jaxsched.pipeline.program` builds and caches the program per abstract input
signature; :mod:`~jaxsched.pipeline.state_step` adapts the step forms users write.
"""

__all__: list[str] = []
