"""``allreduce``: the identity strategy, the user's step as it is (the reference).

The body replays the per-device jaxpr exactly as the user's step traced it, nested calls
and ``check_vma`` typing included, so the compiled program is the user's own and the
results are bit-identical. A ``jax.jit`` step runs as its global program, partitioned by
XLA as the user's own call would be (engines that cut per-device programs into stages
replay the partitioned body instead).

Example:
    >>> AllReduce.name, AllReduce.cost.in_backward
    ('allreduce', False)
"""

from __future__ import annotations

import dataclasses

import jax
from jax.extend import core as jex_core

from jaxsched.runtime.collectives._base import CollectiveState
from jaxsched.sim._costmodel import ALLREDUCE_PATTERN
from jaxsched.plan._planned_step import PlannedStep
from jaxsched.strategies._base import RewrittenBody, UserLayoutStrategy
from jaxsched.strategies._registry import register_strategy

__all__ = ["AllReduce"]


@register_strategy
class AllReduce(UserLayoutStrategy):
    """One reduction after backward, as the user wrote it: the reference every strategy is
    compared against. It issues no bucket collectives, so it takes no ``collective``.

    Example:
        >>> import jaxsched
        >>> sched = jaxsched.schedule(lambda p, o, b: (p, o, {}), strategy=AllReduce())
        >>> AllReduce().name, AllReduce.accepts_collective
        ('allreduce', False)
    """

    name = "allreduce"
    cost = ALLREDUCE_PATTERN
    accepts_collective = False
    # the reference is the user's step as XLA compiles it alone: no per-target options
    compiler_defaults = True

    def per_device(
        self, planned: PlannedStep, values: list[jax.Array], collective_state: CollectiveState
    ) -> tuple[list[jax.Array], CollectiveState]:
        user_body = planned.captured.user_body
        outs = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(user_body, []))(*values)
        return list(outs), collective_state

    def check_vma(self, planned: PlannedStep) -> bool:
        return planned.captured.check_vma

    def rewrite(self, planned: PlannedStep) -> RewrittenBody:
        rewritten = super().rewrite(planned)
        closed = planned.captured.global_step
        if closed is None:
            return rewritten
        run = jex_core.jaxpr_as_fun(closed)
        n_inputs = len(closed.jaxpr.invars)

        def global_body(*inputs):  # the trailing inputs are the per-device body's constants
            return list(run(*inputs[:n_inputs]))

        return dataclasses.replace(rewritten, global_body=global_body)
