"""DeAR: reduce-scatter in backward, update on the local shard, all-gather in the next forward.

Per bucket the scheduled body

1. all-gathers the bucket's parameter shard just before the first forward equation that
   reads one of its parameters (the all-gather deferred from the previous step);
2. reduce-scatters the bucket's gradients right after the last of them is computed;
3. runs the update region on shards (:mod:`jaxsched.rewrite.rules`), so optimizer state
   that mirrors the parameters lives sharded (ZeRO-1 memory);
4. returns the updated parameter shard, which the next step gathers again.

Body inputs: each parameter's flat chunk, the optimizer leaves (flat chunks where
``opt_sharded``), the batch leaves and constants. Outputs: the new parameter chunks, the
new optimizer leaves, then the aux leaves. A bucket's chunks are concatenated before its
one all-gather, which yields exactly the interleaved layout of :mod:`jaxsched.layout`,
so the state stays per leaf and its structure does not depend on the bucket plan.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P

from jaxsched import layout
from jaxsched.analyze import Analysis
from jaxsched.bucketing import Bucket
from jaxsched.rewrite.common import RewrittenBody, read, walk_backward
from jaxsched.rewrite.rules import Shard, ShardContext, apply_rule


def param_layouts(analysis: Analysis, buckets: Sequence[Bucket]) -> list[layout.BucketLayout | None]:
    cap = analysis.captured
    layouts = []
    for b in buckets:
        if not b.params:
            layouts.append(None)
            continue
        avals = [cap.body.invars[cap.body_input("params", i)].aval for i in b.params]
        layouts.append(layout.BucketLayout.of([a.shape for a in avals], [a.dtype for a in avals],
                                              cap.axis_size))
    return layouts


def rewrite_dear(analysis: Analysis, buckets: Sequence[Bucket], opt_sharded: Sequence[bool]) -> RewrittenBody:
    cap = analysis.captured
    body, axis, size = cap.body, cap.axis_name, cap.axis_size
    reds = analysis.reductions
    p_layouts = param_layouts(analysis, buckets)
    g_layouts = []
    for b in buckets:
        ops = [reds[j].operand.aval for j in b.reductions]
        g_layouts.append(layout.BucketLayout.of([a.shape for a in ops], [a.dtype for a in ops], size)
                         if ops else None)
    param_buckets = [k for k, b in enumerate(buckets) if b.params]
    param_invar = {i: body.invars[cap.body_input("params", i)] for i in range(cap.num_params)}
    opt_invar = {j: body.invars[cap.body_input("opt_state", j)] for j in range(cap.num_opt)}
    other_inputs = [k for k, src in enumerate(cap.sources) if src.role in ("batch", "const")]
    ctx = ShardContext(axis, size, analysis.varying)

    def scheduled_body(*inputs):
        n_b, n_o = cap.num_params, cap.num_opt
        param_chunks = inputs[:n_b]
        shards = {} if size == 1 else {
            k: p_layouts[k].join_chunks([param_chunks[i] for i in buckets[k].params]) for k in param_buckets}
        opt_values = inputs[n_b:n_b + n_o]
        env: dict[Any, Any] = {body.invars[k]: v for k, v in zip(other_inputs, inputs[n_b + n_o:])}
        post: dict[Any, Any] = {}

        # Parameters: shards for the update, lazily all-gathered for forward.
        lazy = {}
        for i in range(cap.num_params):
            post[param_invar[i]] = Shard(param_chunks[i], tuple(param_invar[i].aval.shape))
        for k in param_buckets:

            def gather(k=k):
                if size == 1:  # one device: the chunk is the whole flattened leaf
                    for i in buckets[k].params:
                        env[param_invar[i]] = param_chunks[i].reshape(param_invar[i].aval.shape)
                    return
                full = lax.all_gather(shards[k], axis, tiled=True)
                for i, leaf in zip(buckets[k].params, p_layouts[k].unpack(full)):
                    env[param_invar[i]] = leaf
            for i in buckets[k].params:
                lazy[param_invar[i]] = gather
        for j, value in enumerate(opt_values):
            var = opt_invar[j]
            if opt_sharded[j]:
                shard = Shard(value, tuple(var.aval.shape))
                post[var] = shard
                lazy[var] = lambda var=var, shard=shard: env.__setitem__(var, ctx.to_full(shard))
            else:
                env[var] = value

        def emit(bucket: Bucket) -> None:
            k = buckets.index(bucket)
            grads = [read(env, reds[j].operand) for j in bucket.reductions]
            if size == 1:  # nothing to communicate: a sum over one device is the identity
                for j, g in zip(bucket.reductions, grads):
                    post[reds[j].result] = Shard(jnp.ravel(g), tuple(reds[j].operand.aval.shape))
                return
            scattered = lax.psum_scatter(g_layouts[k].pack(grads), axis, scatter_dimension=0, tiled=True)
            for j, chunk in zip(bucket.reductions, g_layouts[k].split_shard(scattered)):
                post[reds[j].result] = Shard(chunk, tuple(reds[j].operand.aval.shape))

        walk_backward(analysis, env, lazy, buckets, emit)

        def read_post(x):
            if isinstance(x, jex_core.Literal):
                return x.val
            if x in post:
                value = post[x]
                if isinstance(value, Shard) and value.full is None and x in env:
                    return Shard(value.chunk, value.shape, env[x])  # gathered for forward
                return value
            if x not in env and x in lazy:
                lazy.pop(x)()
            return read(env, x)

        for i in analysis.update:
            eqn = body.eqns[i]
            for o, val in zip(eqn.outvars, apply_rule(ctx, eqn, [read_post(x) for x in eqn.invars])):
                post[o] = val

        outs = [read_post(body.outvars[k]) for k in cap.outputs]
        new_params, new_opt, aux = (outs[:cap.num_params], outs[cap.num_params:cap.num_params + n_o],
                                    outs[cap.num_params + n_o:])
        results = []
        for i in range(cap.num_params):
            chunk = ctx.to_chunk(new_params[i], param_invar[i].aval.shape)
            results.append(jnp.broadcast_to(chunk, param_chunks[i].shape).astype(param_chunks[i].dtype))
        for j, value in enumerate(new_opt):
            if opt_sharded[j]:
                chunk = ctx.to_chunk(value, opt_invar[j].aval.shape)
                results.append(jnp.broadcast_to(chunk, opt_values[j].shape).astype(opt_invar[j].aval.dtype))
            else:
                results.append(jnp.asarray(ctx.to_full(value)).astype(opt_invar[j].aval.dtype))
        results.extend(ctx.to_full(a) for a in aux)
        return results

    sharded = P(axis)
    opt_specs = tuple(sharded if opt_sharded[j] else cap.in_specs[cap.body_input("opt_state", j)]
                      for j in range(cap.num_opt))
    in_specs = ((sharded,) * cap.num_params + opt_specs
                + tuple(cap.in_specs[k] for k in other_inputs))
    n_state = cap.num_params + cap.num_opt
    out_specs = ((sharded,) * cap.num_params + opt_specs
                 + tuple(cap.out_specs[k] for k in cap.outputs[n_state:]))
    return RewrittenBody(scheduled_body, in_specs, out_specs, ctx.fallbacks)
