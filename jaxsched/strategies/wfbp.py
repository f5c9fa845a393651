"""``wfbp``: one all-reduce per bucket, issued in backward as soon as its gradients exist.

Wait-free backpropagation (Zhang et al., 2017) with tensor fusion (MG-WFBP, Horovod and
DDP buckets). The bucket's gradients are reduced together by the collective's
``all_reduce_tensors`` (one multi-operand psum, or one flattened buffer for a
compressor); the update region then runs unchanged.
Params and optimizer state keep the user's layout.

Example:
    >>> Wfbp.cost.collectives()
    ('all_reduce',)
"""

from __future__ import annotations

from typing import Any


from jaxsched.runtime.collectives.base import BucketSpec
from jaxsched.sim.costmodel import WFBP_PATTERN
from jaxsched.plan.planned_step import PlannedStep
from jaxsched.core.replay import interpret, read
from jaxsched.core.rewrite.backward import walk_backward
from jaxsched.strategies.base import UserLayoutStrategy, reduce_gradients
from jaxsched.strategies.registry import register_strategy

__all__ = ["Wfbp"]


@register_strategy
class Wfbp(UserLayoutStrategy):
    """Per bucket, one all-reduce of the flattened gradients, placed in backward."""

    name = "wfbp"
    cost = WFBP_PATTERN

    def collective_buckets(self, planned: PlannedStep) -> list[BucketSpec]:
        return self.concatenated_gradient_buckets(planned)

    def per_device(self, planned: PlannedStep, values: list, collective_state: Any):
        analysis, buckets = planned.analysis, planned.buckets
        body = planned.captured.body
        reds = analysis.reductions
        specs = self.collective_buckets(planned)
        carried = list(collective_state)
        env = dict(zip(body.invars, values, strict=True))

        def emit(bucket) -> None:
            k = buckets.index(bucket)
            grads = [read(env, reds[j].operand) for j in bucket.reductions]
            sums, carried[k] = reduce_gradients(self.collective, planned, bucket, grads, specs[k], carried[k])
            for j, total in zip(bucket.reductions, sums):
                env[reds[j].result] = total

        walk_backward(analysis, env, {}, buckets, emit)
        interpret((body.eqns[i] for i in analysis.update), lambda x: read(env, x), env.__setitem__)
        return [read(env, x) for x in body.outvars], tuple(carried)
