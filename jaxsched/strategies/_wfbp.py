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


import jax

from jaxsched.runtime.collectives._base import SMALL_TENSOR_BYTES, BucketSpec, CollectiveState, nbytes
from jaxsched.sim._costmodel import WFBP_PATTERN
from jaxsched.plan._planned_step import PlannedStep
from jaxsched.core._replay import read
from jaxsched.core.rewrite._pending_sums import interpret_batching_sums
from jaxsched.core.rewrite._backward import walk_backward
from jaxsched.strategies._base import UserLayoutStrategy, reduce_gradients
from jaxsched.strategies._registry import register_strategy

__all__ = ["Wfbp"]


@register_strategy
class Wfbp(UserLayoutStrategy):
    """Wait-free backpropagation: per bucket, one all-reduce of the flattened gradients,
    issued in backward as soon as the bucket's gradients are ready.

    Args:
      collective: how each bucket travels (default: a plain sum); a compressor's
        [`Collective`][jaxsched.runtime.collectives.Collective] (``jaxsched.compress.TopK(...)``) sends it compressed.

    Example:
        >>> import jaxsched
        >>> strategy = Wfbp(collective=jaxsched.compress.TopK(density=0.01))
        >>> strategy
        Wfbp(collective=TopK)
    """

    name = "wfbp"
    cost = WFBP_PATTERN

    def collective_buckets(self, planned: PlannedStep) -> list[BucketSpec]:
        return self.concatenated_gradient_buckets(planned)

    def per_device(
        self, planned: PlannedStep, values: list[jax.Array], collective_state: CollectiveState
    ) -> tuple[list[jax.Array], CollectiveState]:
        analysis, buckets = planned.analysis, planned.buckets
        body = planned.captured.body
        reds = analysis.reductions
        specs = self.collective_buckets(planned)
        carried = list(collective_state)
        env = dict(zip(body.invars, values, strict=True))
        # A bucket of small all-reduced gradients that a backward loop returns (a scanned
        # model's stacked norm scales and biases) is pure latency, and issued at the loop's
        # exit it opens an async window that XLA's latency-hiding scheduler fills with the
        # head's independent backward (the unembedding's weight gradient), moving it past the
        # loop: its input, the logits' gradient, then stays alive through the whole backward
        # loop. Such a bucket waits for the next bucket's gradients (an optimization barrier:
        # the same values, only ordered) and is reduced with it.
        loops = [body.eqns[i] for i in analysis.backward if body.eqns[i].primitive.name in ("scan", "while")]
        from_loop = {v for eqn in loops for v in eqn.outvars}
        held: list = []  # (bucket, gradients) waiting for the next bucket

        def reduce(bucket, grads) -> None:
            k = buckets.index(bucket)
            sums, carried[k] = reduce_gradients(self.collective, planned, bucket, list(grads), specs[k], carried[k])
            for j, total in zip(bucket.reductions, sums):
                env[reds[j].result] = total

        def emit(bucket) -> None:
            grads = [read(env, reds[j].operand) for j in bucket.reductions]
            if _latency_only(bucket, grads, reds, from_loop):
                held.append((bucket, grads))
                return
            if held:
                waiting, grads = jax.lax.optimization_barrier(([g for _, gs in held for g in gs], grads))
                at = 0
                for b, gs in held:
                    reduce(b, waiting[at : at + len(gs)])
                    at += len(gs)
                held.clear()
            reduce(bucket, grads)

        walk_backward(analysis, env, {}, buckets, emit)
        for b, gs in held:  # no bucket after them: reduced as they are
            reduce(b, gs)
        interpret_batching_sums([body.eqns[i] for i in analysis.update], lambda x: read(env, x), env.__setitem__)
        return [read(env, x) for x in body.outvars], tuple(carried)


def _latency_only(bucket, grads, reds, from_loop) -> bool:
    """An all-reduced bucket of small tensors (one packed buffer) of which a backward loop
    returns a gradient."""
    return (
        not any(reds[j].scattered for j in bucket.reductions)
        and all(nbytes(g) <= SMALL_TENSOR_BYTES for g in grads)
        and any(reds[j].operand in from_loop for j in bucket.reductions)
    )
