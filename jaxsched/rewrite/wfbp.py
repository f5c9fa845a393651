"""WFBP: one all-reduce per bucket, issued in backward as soon as its gradients exist.

The bucket's gradients are flattened and concatenated, reduced with one ``psum`` and
split back; the update region then runs unchanged. Params and optimizer state keep the
user's layout.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax.numpy as jnp
from jax import lax

from jaxsched.analyze import Analysis
from jaxsched.bucketing import Bucket
from jaxsched.rewrite.common import RewrittenBody, read, walk_backward
from jaxsched.replay import bind as _bind


def rewrite_wfbp(analysis: Analysis, buckets: Sequence[Bucket]) -> RewrittenBody:
    cap = analysis.captured
    body, axis = cap.body, cap.axis_name
    reds = analysis.reductions

    def emit(env: dict, bucket: Bucket) -> None:
        grads = [read(env, reds[j].operand) for j in bucket.reductions]
        if cap.axis_size == 1:  # nothing to communicate: a sum over one device is the identity
            for j, g in zip(bucket.reductions, grads):
                env[reds[j].result] = g
            return
        by_dtype: dict = {}
        for j, g in zip(bucket.reductions, grads):
            by_dtype.setdefault(jnp.result_type(g), []).append((j, g))
        for members in by_dtype.values():
            flat = jnp.concatenate([jnp.ravel(g) for _, g in members])
            total = lax.psum(flat, axis)
            offset = 0
            for j, g in members:
                size = math.prod(g.shape)
                env[reds[j].result] = total[offset:offset + size].reshape(g.shape)
                offset += size

    def scheduled_body(*inputs):
        env = dict(zip(body.invars, inputs))
        walk_backward(analysis, env, {}, buckets, lambda b: emit(env, b))
        for i in analysis.update:
            eqn = body.eqns[i]
            for o, val in zip(eqn.outvars, _bind(eqn, [read(env, x) for x in eqn.invars])):
                env[o] = val
        return [read(env, x) for x in body.outvars]

    return RewrittenBody(scheduled_body, cap.in_specs, cap.out_specs, [])
