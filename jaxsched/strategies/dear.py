"""``dear``: reduce-scatter in backward, update on the local shard, all-gather in the next
forward (DeAR, Zhang et al., 2023; Jin's decoupled push and eager pull).

Per bucket the scheduled body

1. all-gathers the bucket's parameter shard just before the first forward equation that
   reads one of its parameters (the all-gather deferred from the previous step);
2. reduce-scatters the bucket's gradients right after the last of them is computed;
3. runs the update region on shards (:mod:`jaxsched.core.rewrite.rules`), so optimizer state
   that mirrors the parameters lives sharded (ZeRO-1 memory);
4. returns the updated parameter shard, which the next step gathers again.

State: each parameter leaf as its flat ``(P * chunk,)`` array sharded over the axis;
optimizer leaves likewise where they are not scalars; the collective's carried state. A
bucket's chunks are concatenated before its one all-gather, which yields exactly the
interleaved layout of :mod:`jaxsched.core.layout`, so the state stays per leaf and its
structure does not depend on the bucket plan (checkpoints restore across plans).

Example:
    >>> Dear.cost.collectives()
    ('reduce_scatter', 'all_gather')
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsched.core import layout
from jaxsched.core.bucketing import is_float
from jaxsched.runtime.collectives.base import BucketSpec
from jaxsched.sim.costmodel import DEAR_PATTERN
from jaxsched.plan.planned_step import PlannedStep, is_abstract
from jaxsched.core.replay import interpret, read
from jaxsched.core.rewrite.backward import walk_backward
from jaxsched.core.rewrite.rules import Shard, ShardContext, apply_rule
from jaxsched.strategies.base import (
    BucketReport,
    RewrittenBody,
    SchedState,
    Strategy,
    check_leaf_counts,
    reduce_gradients,
)
from jaxsched.strategies.registry import register_strategy

__all__ = ["Dear", "DearLayout"]


class DearLayout(NamedTuple):
    """Per program: what is stored sharded, and the bucket layouts.

    Attributes:
      params: per bucket, the layout of its sharded parameters (None if it has none).
      gathered: per bucket, the parameter leaves its all-gather returns.
      grads: per bucket, the layout of its gradients.
      param_sharded, opt_sharded: per leaf, whether it is stored as flat shards. Leaves
        that are not (typed keys, integers, scalars, per-device state, leaves with a
        non-replicated spec, parameters without a reduced gradient, optimizer state whose
        shape is no sharded parameter's) keep the user's layout and spec, whole.
    """

    params: list
    gathered: list
    grads: list
    param_sharded: list
    opt_sharded: list


@register_strategy
class Dear(Strategy):
    """Reduce-scatter + sharded update + deferred all-gather, per bucket."""

    name = "dear"
    cost = DEAR_PATTERN

    # -- layout ---------------------------------------------------------------------------
    def layout(self, planned: PlannedStep) -> DearLayout:
        return planned.memo("dear.layout", lambda: self._layout(planned))

    def _layout(self, planned: PlannedStep) -> DearLayout:
        cap, analysis = planned.captured, planned.analysis
        reds, size = analysis.reductions, planned.axis_size

        def shardable(role: str, index: int, position: int) -> bool:
            aval = planned.body_invar(role, index).aval
            replicated = cap.kind == "pmap" or all(d is None for d in planned.input_spec(role, index))
            return (
                replicated
                and is_float(aval.dtype)
                and math.prod(aval.shape) > 1
                and position not in analysis.per_device_outputs
            )

        bucketed = {i for b in planned.buckets for i in b.params}
        param_sharded = [i in bucketed and shardable("params", i, i) for i in range(cap.num_params)]
        # optimizer state that mirrors a parameter (moments, accumulators) is sharded like
        # it; smaller statistics (adafactor's factored rows and columns) stay whole, so
        # that broadcasting them against a gradient is a local slice, not a gather
        mirrored = _mirrored_params(cap.params_tree, cap.opt_tree)
        opt_sharded = [
            shardable("opt_state", j, cap.num_params + j)
            and (
                j not in mirrored
                or planned.body_invar("opt_state", j).aval.shape == planned.body_invar("params", mirrored[j]).aval.shape
            )
            for j in range(cap.num_opt)
        ]
        p_layouts, gathered, g_layouts = [], [], []
        for b in planned.buckets:
            members = [i for i in b.params if param_sharded[i]]
            avals = [planned.body_invar("params", i).aval for i in members]
            gathered.append(members)
            p_layouts.append(
                layout.BucketLayout.of([a.shape for a in avals], [a.dtype for a in avals], size) if avals else None
            )
            ops = [reds[j].operand.aval for j in b.reductions]
            scattered = any(reds[j].scattered for j in b.reductions)  # blocks of sharded parameters
            g_layouts.append(
                layout.BucketLayout.of([a.shape for a in ops], [a.dtype for a in ops], size)
                if ops and not scattered
                else None
            )
        return DearLayout(p_layouts, gathered, g_layouts, param_sharded, opt_sharded)

    def collective_buckets(self, planned: PlannedStep) -> list[BucketSpec]:
        lay = self.layout(planned)
        specs = self.bucket_specs(
            planned,
            [g.shard_size * planned.axis_size if g else 0 for g in lay.grads],
            [g.dtype if g else np.float32 for g in lay.grads],
            [g.shapes if g else () for g in lay.grads],
            interleaved=True,
            op="reduce_scatter",
        )
        # a bucket of sharded parameters' gradients: its blocks are already what the update
        # runs on (ZeRO-3 as the user laid it out); it travels as wfbp's would
        summed = self.concatenated_gradient_buckets(planned)
        return [summed[k] if _scattered(planned, b) else spec for k, (spec, b) in enumerate(zip(specs, planned.buckets))]

    def _gather_spec(self, planned: PlannedStep, k: int, p_layout) -> BucketSpec:
        return BucketSpec(
            k,
            p_layout.shard_size * planned.axis_size,
            p_layout.dtype,
            planned.axis_size,
            p_layout.shapes,
            interleaved=True,
            kind="parameters",
            form=planned.collective_form("all_gather"),
            mesh_axes=planned.data_mesh_axes,
        )

    # -- conversions ----------------------------------------------------------------------
    def convert(self, planned: PlannedStep, state: NamedTuple) -> SchedState:
        cap = planned.captured
        params, opts = jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state)
        check_leaf_counts(planned, params, opts)
        lay = self.layout(planned)
        opt_sharded = lay.opt_sharded
        params = [
            self._sharded(
                planned,
                leaf,
                planned.body_invar("params", i).aval,
                f"params/{planned.paths[i]}",
                planned.device_stacked("params", i),
            )
            if lay.param_sharded[i]
            else planned.placed(leaf, planned.input_spec("params", i))
            for i, leaf in enumerate(params)
        ]
        opts = [
            self._sharded(
                planned,
                leaf,
                planned.body_invar("opt_state", j).aval,
                f"opt_state[{j}]",
                planned.device_stacked("opt_state", j),
            )
            if opt_sharded[j]
            else planned.placed(leaf, planned.input_spec("opt_state", j))
            for j, leaf in enumerate(opts)
        ]
        return SchedState(
            jax.tree.unflatten(cap.params_tree, params),
            jax.tree.unflatten(cap.opt_tree, opts),
            self.collective_state(planned, getattr(state, "collective_state", None), is_abstract(state)),
        )

    def finalize(self, planned: PlannedStep, state: NamedTuple) -> tuple[Any, Any]:
        cap = planned.captured
        lay = self.layout(planned)
        opt_sharded = lay.opt_sharded
        params = [
            self._unsharded(planned, leaf, planned.body_invar("params", i).aval, planned.device_stacked("params", i))
            if lay.param_sharded[i]
            else leaf
            for i, leaf in enumerate(jax.tree.leaves(state.params))
        ]
        opts = [
            self._unsharded(
                planned, leaf, planned.body_invar("opt_state", j).aval, planned.device_stacked("opt_state", j)
            )
            if opt_sharded[j]
            else leaf
            for j, leaf in enumerate(jax.tree.leaves(state.opt_state))
        ]
        return jax.tree.unflatten(cap.params_tree, params), jax.tree.unflatten(cap.opt_tree, opts)

    @staticmethod
    def _flat_len(planned: PlannedStep, block) -> int:
        return layout.chunk_size(block.shape, planned.axis_size) * planned.axis_size

    def _sharded(self, planned: PlannedStep, leaf: Any, block, name: str, stacked: bool) -> jax.Array:
        flat_len = self._flat_len(planned, block)
        sharding = NamedSharding(planned.mesh, P(planned.axis_name))
        if isinstance(leaf, jax.Array) and leaf.shape == (flat_len,) and leaf.sharding.is_equivalent_to(sharding, 1):
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):  # ahead of time: the layout, no data
            return jax.ShapeDtypeStruct((flat_len,), leaf.dtype, sharding=sharding)
        expected = (len(planned.mesh.devices.flat),) + tuple(block.shape[1:]) if stacked else tuple(block.shape)
        shape = tuple(np.shape(leaf))
        if shape != expected and shape != (flat_len,):
            raise ValueError(
                f"state leaf {name} has shape {shape}; expected the user's {expected} or the scheduled ({flat_len},)"
            )
        if shape == expected:
            user = np.asarray(leaf)
            flat = layout.host_chunks((user[:1] if stacked else user).reshape(block.shape), planned.axis_size)
        else:
            flat = np.asarray(leaf)
        return jax.device_put(flat, sharding)

    def _unsharded(self, planned: PlannedStep, leaf: Any, block, stacked: bool) -> Any:
        """A leaf in the user's layout again. Told apart by shape, never by sharding: XLA may
        hand back an equivalent sharding under another spec (a size-1 mesh axis dropped)."""
        flat_len = self._flat_len(planned, block)
        user_shape = (len(planned.mesh.devices.flat),) + tuple(block.shape[1:]) if stacked else tuple(block.shape)
        shape = tuple(np.shape(leaf))
        flat = shape == (flat_len,) and isinstance(leaf, jax.Array) and not leaf.sharding.is_fully_replicated
        if shape == user_shape and not flat:
            return leaf  # still in the user's layout (no step has run yet)
        if shape != (flat_len,):
            raise ValueError(
                f"a sharded state leaf has shape {shape}; expected the user's {user_shape} or "
                f"dear's flat ({flat_len},): was the state made by another schedule?"
            )
        full = _host_value(leaf)[: math.prod(block.shape)].reshape(block.shape)
        if stacked:
            full = np.repeat(full, len(planned.mesh.devices.flat), axis=0)
        return full

    # -- rewrite --------------------------------------------------------------------------
    def rewrite(self, planned: PlannedStep) -> RewrittenBody:
        cap, analysis, buckets = planned.captured, planned.analysis, planned.buckets
        body, axis, size = cap.body, planned.axis_name, planned.axis_size
        reds = analysis.reductions
        lay = self.layout(planned)
        specs = self.collective_buckets(planned)
        coll_specs = self.collective_state_specs(planned)
        n_p, n_o = cap.num_params, cap.num_opt
        n_state = n_p + n_o + len(coll_specs)
        param_buckets = [k for k in range(len(buckets)) if lay.gathered[k]]
        param_invar = {i: planned.body_invar("params", i) for i in range(n_p)}
        opt_invar = {j: planned.body_invar("opt_state", j) for j in range(n_o)}
        ctx = ShardContext(axis, size, analysis.varying)

        def scheduled_body(*inputs):
            state, batch, consts = self.split_inputs(planned, inputs, n_state)
            param_chunks, opt_values = state[:n_p], state[n_p : n_p + n_o]
            carried = list(self.local_collective_state(planned, state[n_p + n_o :]))
            values = planned.body_arguments([None] * n_p, [None] * n_o, batch, consts)
            env: dict[Any, Any] = {
                v: x
                for v, src, x in zip(body.invars, cap.sources, values, strict=True)
                if src.role in ("batch", "const")
            }
            post: dict[Any, Any] = {}

            # Parameters: shards for the update, lazily all-gathered for forward.
            lazy = {}
            for i in range(n_p):
                if lay.param_sharded[i]:
                    post[param_invar[i]] = Shard(param_chunks[i], tuple(param_invar[i].aval.shape))
                else:
                    env[param_invar[i]] = param_chunks[i]  # whole, in the user's layout
            for k in param_buckets:

                def gather(k=k):
                    if size == 1:  # one device: the chunk is the whole flattened leaf
                        for i in lay.gathered[k]:
                            env[param_invar[i]] = param_chunks[i].reshape(param_invar[i].aval.shape)
                        return
                    leaves, carried[k] = self.collective.all_gather_tensors(
                        [param_chunks[i] for i in lay.gathered[k]],
                        axis,
                        self._gather_spec(planned, k, lay.params[k]),
                        carried[k],
                    )
                    for i, leaf in zip(lay.gathered[k], leaves):
                        env[param_invar[i]] = leaf

                for i in lay.gathered[k]:
                    lazy[param_invar[i]] = gather
            for j, value in enumerate(opt_values):
                var = opt_invar[j]
                if lay.opt_sharded[j]:
                    shard = Shard(value, tuple(var.aval.shape))
                    post[var] = shard
                    lazy[var] = lambda var=var, shard=shard: env.__setitem__(var, ctx.to_full(shard))
                else:
                    env[var] = value

            def emit(bucket) -> None:
                k = buckets.index(bucket)
                grads = [read(env, reds[j].operand) for j in bucket.reductions]
                if _scattered(planned, bucket):
                    blocks, carried[k] = reduce_gradients(self.collective, planned, bucket, grads, specs[k], carried[k])
                    for j, total in zip(bucket.reductions, blocks):
                        post[reds[j].result] = total
                    return
                if not bucket.params:
                    # no parameter's gradient (a global example count, a loss summed with
                    # the gradients): the update keeps no shard of it, so it is summed whole
                    for j, total in zip(bucket.reductions, lax.psum(tuple(grads), axis)):
                        post[reds[j].result] = total
                    return
                if size == 1:  # nothing to communicate: a sum over one device is the identity
                    for j, g in zip(bucket.reductions, grads):
                        post[reds[j].result] = Shard(jnp.ravel(g), tuple(reds[j].operand.aval.shape))
                    return
                chunks, carried[k] = self.collective.reduce_scatter_tensors(grads, axis, specs[k], carried[k])
                for j, chunk in zip(bucket.reductions, chunks):
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

            def run(eqn, vals):
                ctx.top = eqn  # what a fallback inside it is attributed to (bucket_report)
                return apply_rule(ctx, eqn, vals)

            interpret((body.eqns[i] for i in analysis.update), read_post, post.__setitem__, run=run)
            ctx.top = None

            outs = [read_post(body.outvars[k]) for k in cap.outputs]
            new_params, new_opt, aux = outs[:n_p], outs[n_p : n_p + n_o], outs[n_p + n_o :]
            # every state leaf leaves in the dtype the user's step gives it (which may
            # differ from its input's: the next call then gets a program for it)
            out_dtype = [body.outvars[k].aval.dtype for k in cap.outputs[: n_p + n_o]]
            results = []
            for i in range(n_p):
                if not lay.param_sharded[i]:
                    results.append(ctx.to_full(new_params[i]))
                    continue
                chunk = ctx.to_chunk(new_params[i], param_invar[i].aval.shape)
                results.append(jnp.broadcast_to(chunk, param_chunks[i].shape).astype(out_dtype[i]))
            for j, value in enumerate(new_opt):
                if lay.opt_sharded[j]:
                    chunk = ctx.to_chunk(value, opt_invar[j].aval.shape)
                    results.append(jnp.broadcast_to(chunk, opt_values[j].shape).astype(out_dtype[n_p + j]))
                else:
                    results.append(_as_dtype(ctx.to_full(value), out_dtype[n_p + j]))
            results += self.stacked_collective_leaves(tuple(carried))
            results += [ctx.to_full(a) for a in aux]
            return results

        sharded = P(axis)
        in_specs = (
            tuple(sharded if lay.param_sharded[i] else planned.input_spec("params", i) for i in range(n_p))
            + tuple(sharded if lay.opt_sharded[j] else planned.input_spec("opt_state", j) for j in range(n_o))
            + coll_specs
        )
        out_specs = (
            tuple(sharded if lay.param_sharded[i] else planned.output_spec(i) for i in range(n_p))
            + tuple(sharded if lay.opt_sharded[j] else planned.output_spec(n_p + j) for j in range(n_o))
            + coll_specs
        )
        return RewrittenBody(
            scheduled_body, in_specs, out_specs, ctx.fallbacks, bucket_report=lambda: self._bucket_report(planned, ctx)
        )

    def _bucket_report(self, planned: PlannedStep, ctx: ShardContext) -> list[BucketReport]:
        """Per bucket, the fallbacks whose top-level equation reads what the bucket holds:
        its reduced gradients, its parameters, or optimizer state that mirrors them."""
        cap, analysis = planned.captured, planned.analysis
        body = cap.body
        bucket_of_param = {i: k for k, b in enumerate(planned.buckets) for i in b.params}
        bits: dict[Any, int] = {}
        for k, b in enumerate(planned.buckets):
            for j in b.reductions:
                bits[analysis.reductions[j].result] = bits.get(analysis.reductions[j].result, 0) | 1 << k
        for i, k in bucket_of_param.items():
            bits[planned.body_invar("params", i)] = 1 << k
        for j, i in _mirrored_params(cap.params_tree, cap.opt_tree).items():
            if i in bucket_of_param:
                bits[planned.body_invar("opt_state", j)] = 1 << bucket_of_param[i]
        reads: dict[int, int] = {}  # id of a top-level equation -> buckets it reads
        for i in analysis.update:
            eqn = body.eqns[i]
            read_bits = 0
            for x in eqn.invars:
                read_bits |= bits.get(x, 0) if isinstance(x, jex_core.Var) else 0
            reads[id(eqn)] = read_bits
            for o in eqn.outvars:
                bits[o] = read_bits
        report = []
        for k, b in enumerate(planned.buckets):
            found = tuple(dict.fromkeys(key for key, top in ctx.sites if reads.get(id(top), 0) >> k & 1))
            report.append(BucketReport(k, tuple(planned.paths[i] for i in b.params), not found, found))
        return report


def _scattered(planned: PlannedStep, bucket: Any) -> bool:
    """Whether ``bucket`` holds gradients of parameters sharded over data axes (FSDP)."""
    return any(planned.analysis.reductions[j].scattered for j in bucket.reductions)


def _mirrored_params(params_tree: Any, opt_tree: Any) -> dict[int, int]:
    """For optimizer-state leaves inside a subtree shaped like the params tree (optax's
    per-parameter statistics), the index of the parameter each one stands for."""
    if params_tree.num_leaves == 1:  # every leaf would match a one-leaf tree
        return {}
    indexed = jax.tree.unflatten(opt_tree, range(opt_tree.num_leaves))
    found: dict[int, int] = {}
    like_params = lambda t: not isinstance(t, int) and jax.tree.structure(t) == params_tree
    for sub in jax.tree.leaves(indexed, is_leaf=like_params):
        if like_params(sub):
            found.update((j, i) for i, j in enumerate(jax.tree.leaves(sub)))
    return found


def _as_dtype(value: Any, dtype) -> Any:
    value = jnp.asarray(value) if not isinstance(value, jax.Array) else value
    return value if value.dtype == dtype else value.astype(dtype)


def _host_value(leaf: Any) -> np.ndarray:
    """The whole array on this host, also when other processes hold some of its shards."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)
