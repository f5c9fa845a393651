"""``dear``: reduce-scatter in backward, update on the local shard, all-gather in the next
forward (DeAR, Zhang et al., 2023; Jin's decoupled push and eager pull).

Per bucket the scheduled body

1. all-gathers the bucket's parameter shard just before the first forward equation that
   reads one of its parameters (the all-gather deferred from the previous step);
2. reduce-scatters the bucket's gradients right after the last of them is computed;
3. runs the update region on shards (`jaxsched.core.rewrite._rules`), so optimizer state
   that mirrors the parameters lives sharded (ZeRO-1 memory);
4. returns the updated parameter shard, which the next step gathers again.

State: each parameter leaf as its flat ``(P * chunk,)`` array sharded over the axis;
optimizer leaves likewise where they are not scalars; the collective's carried state. A
bucket's chunks are concatenated before its one all-gather, which yields exactly the
interleaved layout of `jaxsched.core._layout`, so the state stays per leaf and its
structure does not depend on the bucket plan (checkpoints restore across plans).

Example:
    >>> Dear.cost.collectives()
    ('reduce_scatter', 'all_gather')
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsched._errors import JaxschedValueError
from jaxsched.core import _layout as layout
from jaxsched.core._axes import as_axes
from jaxsched.core._bucketing import is_float, match_reductions
from jaxsched.runtime.collectives._base import BucketSpec
from jaxsched.runtime.collectives._torus import scatter_stages
from jaxsched.sim._costmodel import DEAR_PATTERN
from jaxsched.plan._planned_step import PlannedStep, is_abstract
from jaxsched.core.rewrite._pending_sums import PendingSums, interpret_batching_sums
from jaxsched.core._replay import read
from jaxsched.core.rewrite._backward import walk_backward
from jaxsched.core.rewrite._rules import Shard, ShardContext, apply_rule
from jaxsched.strategies._base import (
    BucketReport,
    RewrittenBody,
    SchedState,
    ScheduledState,
    Strategy,
    check_leaf_counts,
    reduce_gradients,
    scatter_block,
)
from jaxsched.strategies._registry import register_strategy

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
      param_chunking, opt_chunking: per leaf, how its flat shards are spread
        (`Chunking`), None for a leaf kept whole.
      bucket_chunking: per bucket, the chunking of its gradients and parameters.

    ``Dear.layout(planned)`` builds it when the step is traced.

    Example:
      >>> import jaxsched
      >>> from jaxsched.strategies import Dear
      >>> from jaxsched.demo import steps
      >>> dear, planned = steps.planned_example(Dear())
      >>> layout = dear.layout(planned)
      >>> layout.param_sharded, [c.axes for c in layout.bucket_chunking]  # every leaf as flat shards
      ([True, True, True, True], [('data',)])
    """

    params: list
    gathered: list
    grads: list
    param_sharded: list
    opt_sharded: list
    param_chunking: list = []
    opt_chunking: list = []
    bucket_chunking: list = []


class Chunking(NamedTuple):
    """How a leaf's flat shards are spread over the mesh.

    Attributes:
      axes: the mesh axes a tensor's flat chunks are spread over: the data axes for a
        replicated parameter; for an HSDP parameter, the replica axes its block is summed
        over (the update shards over them too).
      size: devices along ``axes``.
      block_axes, block_dim, blocks: the data axes, the dimension and the number of blocks
        the user split an HSDP parameter over (``()``, None and 1 for a replicated one): each
        block is chunked on its own.

    Example:
        >>> Chunking(("data",), 8).spec()
        P('data',)
    """

    axes: tuple[str, ...]
    size: int
    block_axes: tuple[str, ...] = ()
    block_dim: int | None = None
    blocks: int = 1

    @property
    def axis(self) -> Any:
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def spec(self) -> P:
        """The flat global array's spec: blocks major, then the chunks of each.

        Returns:
          A ``PartitionSpec`` over ``block_axes`` and ``axes``.

        Example:
            >>> Chunking(("replica",), 2, block_axes=("fsdp",), block_dim=0, blocks=4).spec()
            P(('fsdp', 'replica'),)
        """
        axes = tuple(self.block_axes) + tuple(self.axes)
        return P(axes[0] if len(axes) == 1 else axes)

    def shard(self, chunk: Any, shape: tuple) -> Shard:
        """This device's chunk as the update region's `Shard`.

        Over the context's data axes, unless it is an HSDP block's, chunked over the replica
        axes.

        Args:
          chunk: this device's flat chunk.
          shape: the whole leaf's shape.

        Returns:
          The `Shard`.

        Example:
          >>> import jax.numpy as jnp
          >>> from jaxsched.strategies import _dear as dear
          >>> shard = dear.Chunking(("data",), 2).shard(jnp.ones(3), (6,))
          >>> shard.shape, shard.axes  # a replicated leaf: over the context's data axes
          ((6,), None)
        """
        if not self.block_axes:
            return Shard(chunk, tuple(shape))
        return Shard(chunk, tuple(shape), None, self.axis, self.size)


@register_strategy
class Dear(Strategy):
    """Per bucket: a reduce-scatter in backward, the optimizer update on this device's
    shard, and the all-gather of the updated parameters deferred to the next step's forward.

    Parameters and optimizer state stay sharded between steps (`DearLayout`);
    ``sched.finalize`` gathers them back into the user's trees.

    Args:
      collective: how each bucket travels (default: a plain reduce-scatter and all-gather).

    Example:
        >>> import jaxsched
        >>> Dear().name, Dear().keeps_user_layout
        ('dear', False)
    """

    name = "dear"
    cost = DEAR_PATTERN

    # -- layout ---------------------------------------------------------------------------
    def layout(self, planned: PlannedStep) -> DearLayout:
        return planned.memo("dear.layout", lambda: self._layout(planned))

    def _layout(self, planned: PlannedStep) -> DearLayout:
        cap, analysis = planned.captured, planned.analysis
        reds = analysis.reductions
        data = Chunking(tuple(as_axes(planned.axis_name)), planned.axis_size)

        def chunkable(role: str, index: int, position: int) -> bool:
            aval = planned.body_invar(role, index).aval
            return is_float(aval.dtype) and math.prod(aval.shape) > 1 and position not in analysis.per_device_outputs

        def replicated(role: str, index: int) -> bool:
            return cap.kind == "pmap" or all(d is None for d in planned.input_spec(role, index))

        def block_chunking(role: str, index: int, reduction: Any) -> Chunking | None:
            """An HSDP block summed over replica axes: chunked over them, block by block."""
            if reduction is None or not reduction.scattered or not reduction.sum_axes:
                return None
            spec = planned.input_spec(role, index)
            on = [(d, tuple(as_axes(e))) for d, e in enumerate(spec) if e is not None]
            if len(on) != 1 or on[0][1] != tuple(reduction.scatter_axes):
                return None
            d, axes = on[0]
            size = math.prod(planned.mesh.shape[a] for a in reduction.sum_axes)
            blocks = math.prod(planned.mesh.shape[a] for a in axes)
            return Chunking(tuple(reduction.sum_axes), size, axes, d, blocks)

        reduction_of = dict(zip(range(cap.num_params), match_reductions(analysis)))
        bucketed = {i for b in planned.buckets for i in b.params}
        param_chunking: list = []
        for i in range(cap.num_params):
            j = reduction_of.get(i)
            red = reds[j] if j is not None else None
            if i not in bucketed or not chunkable("params", i, i):
                param_chunking.append(None)
            elif replicated("params", i) and (red is None or not red.scattered):
                param_chunking.append(data)
            else:
                param_chunking.append(block_chunking("params", i, red))
        # optimizer state that mirrors a parameter (moments, accumulators) is sharded like
        # it; smaller statistics (adafactor's factored rows and columns) stay whole, so
        # that broadcasting them against a gradient is a local slice, not a gather
        mirrored = _mirrored_params(cap.params_tree, cap.opt_tree)
        opt_chunking: list = []
        for j in range(cap.num_opt):
            m = mirrored.get(j)
            same_shape = m is not None and (
                planned.body_invar("opt_state", j).aval.shape == planned.body_invar("params", m).aval.shape
            )
            if not chunkable("opt_state", j, cap.num_params + j) or (m is not None and not same_shape):
                opt_chunking.append(None)
            elif replicated("opt_state", j):
                opt_chunking.append(data)
            elif m is not None and param_chunking[m] is not None and param_chunking[m].block_axes:
                same_spec = planned.input_spec("opt_state", j) == planned.input_spec("params", m)
                opt_chunking.append(param_chunking[m] if same_spec else None)
            else:
                opt_chunking.append(None)
        p_layouts, gathered, g_layouts, bucket_chunking = [], [], [], []
        for b in planned.buckets:
            scattered = any(reds[j].scattered for j in b.reductions)  # blocks of sharded parameters
            first = reds[b.reductions[0]] if b.reductions else None
            chunking = block_chunking("params", b.params[0], first) if (scattered and b.params) else None
            chunking = chunking if scattered else data
            bucket_chunking.append(chunking)
            size = chunking.size if chunking is not None else planned.axis_size
            members = [
                i
                for i in b.params
                if param_chunking[i] is not None
                and chunking is not None
                and param_chunking[i][:2] == chunking[:2]  # chunked over the bucket's axes
            ]
            avals = [planned.body_invar("params", i).aval for i in members]
            gathered.append(members)
            p_layouts.append(
                layout.BucketLayout.of([a.shape for a in avals], [a.dtype for a in avals], size) if avals else None
            )
            # a block's gradient is reduce-scattered into it first: what the bucket chunks
            ops = [(reds[j].result if reds[j].scattered else reds[j].operand).aval for j in b.reductions]
            g_layouts.append(
                layout.BucketLayout.of([a.shape for a in ops], [a.dtype for a in ops], size)
                if ops and chunking is not None
                else None
            )
        param_sharded = [c is not None for c in param_chunking]
        opt_sharded = [c is not None for c in opt_chunking]
        return DearLayout(
            p_layouts, gathered, g_layouts, param_sharded, opt_sharded, param_chunking, opt_chunking, bucket_chunking
        )

    def collective_buckets(self, planned: PlannedStep) -> list[BucketSpec]:
        lay = self.layout(planned)
        specs = self.bucket_specs(
            planned,
            [g.shard_size * g.axis_size if g else 0 for g in lay.grads],
            [g.dtype if g else np.float32 for g in lay.grads],
            [g.shapes if g else () for g in lay.grads],
            interleaved=True,
            op="reduce_scatter",
        )
        # a bucket of FSDP blocks summed over no other axis: the blocks are what the update
        # runs on (ZeRO-3 as the user laid it out); it travels as wfbp's would
        summed = self.concatenated_gradient_buckets(planned)
        out = []
        for k, (spec, chunking) in enumerate(zip(specs, lay.bucket_chunking)):
            if chunking is None:
                out.append(summed[k])
            elif chunking.block_axes:  # HSDP: chunked over the replica axes
                out.append(
                    dataclasses.replace(
                        spec,
                        axis_size=chunking.size,
                        mesh_axes=_mesh_axes(planned, chunking),
                        scatter_stages=scatter_stages(planned.mesh, chunking.axes),
                    )
                )
            else:
                out.append(spec)
        return out

    def _gather_spec(self, planned: PlannedStep, k: int, p_layout) -> BucketSpec:
        chunking = self.layout(planned).bucket_chunking[k]
        return BucketSpec(
            k,
            p_layout.shard_size * chunking.size,
            p_layout.dtype,
            chunking.size,
            p_layout.shapes,
            interleaved=True,
            kind="parameters",
            form=planned.collective_form("all_gather"),
            mesh_axes=_mesh_axes(planned, chunking),
        )

    # -- conversions ----------------------------------------------------------------------
    def convert(self, planned: PlannedStep, state: ScheduledState) -> SchedState:
        cap = planned.captured
        params, opts = jax.tree.leaves(state.params), jax.tree.leaves(state.opt_state)
        check_leaf_counts(planned, params, opts)
        lay = self.layout(planned)
        params = [
            self._sharded(planned, leaf, "params", i, lay.param_chunking[i])
            if lay.param_sharded[i]
            else planned.placed(leaf, planned.input_spec("params", i))
            for i, leaf in enumerate(params)
        ]
        opts = [
            self._sharded(planned, leaf, "opt_state", j, lay.opt_chunking[j])
            if lay.opt_sharded[j]
            else planned.placed(leaf, planned.input_spec("opt_state", j))
            for j, leaf in enumerate(opts)
        ]
        return SchedState(
            jax.tree.unflatten(cap.params_tree, params),
            jax.tree.unflatten(cap.opt_tree, opts),
            self.collective_state(planned, getattr(state, "collective_state", None), is_abstract(state)),
        )

    def finalize(self, planned: PlannedStep, state: ScheduledState) -> tuple[Any, Any]:
        cap = planned.captured
        lay = self.layout(planned)
        params = [
            self._unsharded(planned, leaf, "params", i, lay.param_chunking[i]) if lay.param_sharded[i] else leaf
            for i, leaf in enumerate(jax.tree.leaves(state.params))
        ]
        opts = [
            self._unsharded(planned, leaf, "opt_state", j, lay.opt_chunking[j]) if lay.opt_sharded[j] else leaf
            for j, leaf in enumerate(jax.tree.leaves(state.opt_state))
        ]
        return jax.tree.unflatten(cap.params_tree, params), jax.tree.unflatten(cap.opt_tree, opts)

    @staticmethod
    def _flat_len(block: Any, chunking: Chunking) -> int:
        """The flat global array's length: per block, the padded chunks of every device."""
        return layout.chunk_size(block.shape, chunking.size) * chunking.size * chunking.blocks

    @staticmethod
    def _user_shape(planned: PlannedStep, block: Any, chunking: Chunking, stacked: bool) -> tuple[int, ...]:
        if stacked:
            return (len(planned.mesh.devices.flat),) + tuple(block.shape[1:])
        shape = list(block.shape)
        if chunking.block_dim is not None:
            shape[chunking.block_dim] *= chunking.blocks
        return tuple(shape)

    def _sharded(
        self, planned: PlannedStep, leaf: Any, role: str, index: int, chunking: Chunking
    ) -> jax.Array | jax.ShapeDtypeStruct:
        block = planned.body_invar(role, index).aval
        stacked = planned.device_stacked(role, index)
        name = f"params/{planned.paths[index]}" if role == "params" else f"opt_state[{index}]"
        flat_len = self._flat_len(block, chunking)
        sharding = NamedSharding(planned.mesh, chunking.spec())
        if isinstance(leaf, jax.Array) and leaf.shape == (flat_len,) and leaf.sharding.is_equivalent_to(sharding, 1):
            # the same layout; an Explicit mesh types it by its spec, so spell it as the program does
            return leaf if leaf.sharding == sharding else jax.device_put(leaf, sharding)
        if isinstance(leaf, jax.ShapeDtypeStruct):  # ahead of time: the layout, no data
            return jax.ShapeDtypeStruct((flat_len,), leaf.dtype, sharding=sharding)
        expected = self._user_shape(planned, block, chunking, stacked)
        shape = tuple(np.shape(leaf))
        if shape != expected and shape != (flat_len,):
            raise JaxschedValueError(
                f"state leaf {name} has shape {shape}; expected the user's {expected} or the scheduled ({flat_len},)"
            )
        if shape == expected:
            user = _host_value(leaf)
            user = (user[:1] if stacked else user).reshape(expected if not stacked else block.shape)
            blocks = (
                np.split(user, chunking.blocks, axis=chunking.block_dim) if chunking.block_dim is not None else [user]
            )
            flat = np.concatenate([layout.host_chunks(b, chunking.size) for b in blocks])
        else:
            flat = _host_value(leaf)
        return jax.make_array_from_callback(flat.shape, sharding, lambda at: flat[at])

    def _unsharded(self, planned: PlannedStep, leaf: Any, role: str, index: int, chunking: Chunking) -> Any:
        """A leaf in the user's layout again, on the mesh as the step places it. Told apart by
        shape, never by sharding: XLA may hand back an equivalent sharding under another
        spec (a size-1 mesh axis dropped)."""
        block = planned.body_invar(role, index).aval
        stacked = planned.device_stacked(role, index)
        flat_len = self._flat_len(block, chunking)
        user_shape = self._user_shape(planned, block, chunking, stacked)
        shape = tuple(np.shape(leaf))
        flat = shape == (flat_len,) and isinstance(leaf, jax.Array) and not leaf.sharding.is_fully_replicated
        if shape == user_shape and not flat:
            return leaf  # still in the user's layout (no step has run yet)
        if shape != (flat_len,):
            raise JaxschedValueError(
                f"a sharded state leaf has shape {shape}; expected the user's {user_shape} or "
                f"dear's flat ({flat_len},): was the state made by another schedule?"
            )
        rows = _host_value(leaf).reshape(chunking.blocks, -1)[:, : math.prod(block.shape)]
        blocks = [row.reshape(block.shape) for row in rows]
        full = np.concatenate(blocks, axis=chunking.block_dim) if chunking.block_dim is not None else blocks[0]
        if stacked:
            full = np.repeat(full, len(planned.mesh.devices.flat), axis=0)
        return planned.placed(full, planned.input_spec(role, index))  # on the mesh, as the step returns it

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
        ctx = ShardContext(axis, size, analysis.varying_axes)
        param_chunking, opt_chunking = lay.param_chunking, lay.opt_chunking

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
                    post[param_invar[i]] = param_chunking[i].shard(param_chunks[i], param_invar[i].aval.shape)
                else:
                    env[param_invar[i]] = param_chunks[i]  # whole, in the user's layout
            for k in param_buckets:

                def gather(k=k):
                    chunking = lay.bucket_chunking[k]
                    if chunking.size == 1:  # one device: the chunk is the whole flattened leaf
                        for i in lay.gathered[k]:
                            env[param_invar[i]] = param_chunks[i].reshape(param_invar[i].aval.shape)
                        return
                    leaves, carried[k] = self.collective.all_gather_tensors(
                        [param_chunks[i] for i in lay.gathered[k]],
                        chunking.axis,
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
                    shard = opt_chunking[j].shard(value, var.aval.shape)
                    post[var] = shard
                    lazy[var] = lambda var=var, shard=shard: env.__setitem__(var, ctx.to_full(shard))
                else:
                    env[var] = value

            def emit(bucket) -> None:
                k = buckets.index(bucket)
                grads = [read(env, reds[j].operand) for j in bucket.reductions]
                chunking = lay.bucket_chunking[k]
                if _scattered(planned, bucket) and (chunking is None or not bucket.params):
                    blocks, carried[k] = reduce_gradients(self.collective, planned, bucket, grads, specs[k], carried[k])
                    for j, total in zip(bucket.reductions, blocks):
                        post[reds[j].result] = total
                    return
                if _scattered(planned, bucket):
                    # HSDP: each gradient reduce-scattered into its block, then the blocks
                    # reduce-scattered over the replica axes: the update shards over them too
                    blocks = [scatter_block(g, reds[j], planned.mesh) for g, j in zip(grads, bucket.reductions)]
                    chunks, carried[k] = self.collective.reduce_scatter_tensors(
                        blocks, chunking.axis, specs[k], carried[k]
                    )
                    for j, chunk in zip(bucket.reductions, chunks):
                        post[reds[j].result] = chunking.shard(chunk, reds[j].result.aval.shape)
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
                        return dataclasses.replace(value, full=env[x])  # gathered for forward
                    return value
                if x not in env and x in lazy:
                    lazy.pop(x)()
                return read(env, x)

            sums = PendingSums()  # global norms' per-leaf sums: one all-reduce, not one each

            def run(eqn, vals):
                ctx.top = eqn  # what a fallback inside it is attributed to (bucket_report)
                # only a top-level sum is deferred (never one inside a loop's or branch's body)
                ctx.sums = sums if eqn.primitive.name == "reduce_sum" else None
                try:
                    return apply_rule(ctx, eqn, vals)
                finally:
                    ctx.sums = None

            update = [body.eqns[i] for i in analysis.update]
            interpret_batching_sums(update, read_post, post.__setitem__, run=run, sums=sums)
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
                like = param_chunking[i].shard(param_chunks[i], param_invar[i].aval.shape)
                chunk = ctx.to_chunk(new_params[i], param_invar[i].aval.shape, like)
                results.append(jnp.broadcast_to(chunk, param_chunks[i].shape).astype(out_dtype[i]))
            for j, value in enumerate(new_opt):
                if lay.opt_sharded[j]:
                    like = opt_chunking[j].shard(opt_values[j], opt_invar[j].aval.shape)
                    chunk = ctx.to_chunk(value, opt_invar[j].aval.shape, like)
                    results.append(jnp.broadcast_to(chunk, opt_values[j].shape).astype(out_dtype[n_p + j]))
                else:
                    results.append(_as_dtype(ctx.to_full(value), out_dtype[n_p + j]))
            results += self.stacked_collective_leaves(tuple(carried))
            results += [ctx.to_full(a) for a in aux]
            return results

        param_specs = tuple(c.spec() if c is not None else None for c in param_chunking)
        opt_specs = tuple(c.spec() if c is not None else None for c in opt_chunking)
        in_specs = (
            tuple(param_specs[i] or planned.input_spec("params", i) for i in range(n_p))
            + tuple(opt_specs[j] or planned.input_spec("opt_state", j) for j in range(n_o))
            + coll_specs
        )
        out_specs = (
            tuple(param_specs[i] or planned.output_spec(i) for i in range(n_p))
            + tuple(opt_specs[j] or planned.output_spec(n_p + j) for j in range(n_o))
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


def _mesh_axes(planned: PlannedStep, chunking: Chunking) -> tuple[tuple[str, int], ...]:
    return tuple((a, int(planned.mesh.shape[a])) for a in chunking.axes)


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
