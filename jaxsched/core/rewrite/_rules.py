"""Rules that run the update region on shards: one rule per primitive.

A value in the update region is either *full* (an ordinary array, the same on every
device) or a `Shard`: this device's flat chunk of a full tensor (see
`jaxsched.core._layout`). Rules keep values sharded where that is exact:

* elementwise primitives run on chunks (full operands are sliced locally, no traffic);
* reshapes keep the chunk (row-major order is preserved);
* reductions over every axis become a local masked reduction plus one ``psum``/``pmax``
  (``pmin``/``pmax`` of booleans for ``reduce_and``/``reduce_or``, the finite checks of
  loss scaling); over some axes, a partial result the size of the output and one
  collective of it (adafactor's factored row and column statistics);
* a user ``psum`` of a device-invariant value becomes a multiply by the axis size;
* ``cond``/``switch`` on a device-invariant index runs its branches with these rules, and
  ``scan`` over full inputs its body, sharded carries staying sharded.

Anything else gathers its sharded operands (one all-gather each) and runs unchanged on
full tensors: DeAR's lazy update, applied only where it is needed. That fallback is
reported once per primitive and source line.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from jaxsched._errors import JaxschedWarning
from jaxsched.core import _layout as layout
from jaxsched.core._axes import AxisName, as_axes
from jaxsched.core import _primitives as primitives
from jaxsched.core._primitives import CALL_PRIMITIVES, VMA_TYPING, scan_counts
from jaxsched.core._replay import bind as _bind
from jaxsched.core._replay import at_source, aval_of, eval_inline, is_var, source_line
from jaxsched.core._replay import inner_jaxpr as _inner_jaxpr

__all__ = [
    "apply_rule",
    "broadcast_in_dim_rule",
    "call_rule",
    "cond_rule",
    "ELEMENTWISE",
    "elementwise_rule",
    "eval_sharded",
    "FallbackWarning",
    "full_rule",
    "identity_rule",
    "psum_rule",
    "reshape_rule",
    "RESHAPES",
    "Rule",
    "RULES",
    "scan_rule",
    "Shard",
    "ShardContext",
]


@dataclasses.dataclass(frozen=True)
class Shard:
    """This device's flat chunk of a tensor of ``shape`` that is the same on every device of
    the axes it is chunked over.

    ``full`` is the whole tensor when the program already holds it (a parameter gathered
    for forward), so a rule that needs it costs no second all-gather. ``axes`` and ``size``
    name the mesh axes the chunks are spread over and how many devices they span (None and
    0: the context's data axes); an HSDP parameter block is chunked over the replica axes
    only, its blocks differing across the others.
    """

    chunk: jax.Array
    shape: tuple[int, ...]
    full: jax.Array | None = None
    axes: AxisName | None = None
    size: int = 0

    @property
    def dtype(self):
        return self.chunk.dtype

    def with_chunk(self, chunk: jax.Array, shape: Sequence[int] | None = None) -> "Shard":
        """Another chunk over the same axes (of a tensor of ``shape``, default this one's)."""
        return Shard(chunk, tuple(self.shape if shape is None else shape), None, self.axes, self.size)


class FallbackWarning(JaxschedWarning):
    """An update-region primitive could not run on shards and was run on gathered tensors.

    The result stays exact; the warning names the primitive and its source line, because the
    gather costs the traffic a sharded update (``dear``) saves. Filter it with
    ``warnings.simplefilter("error", jaxsched.FallbackWarning)`` to make it fatal.

    Example:
        >>> import jax, optax, jaxsched
        >>> from jaxsched.demo import steps
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> import warnings
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> flip = optax.stateless(lambda u, p: jax.tree.map(lambda x: x + jax.lax.rev(x, (0,)), u))
        >>> tx = optax.chain(flip, optax.sgd(0.1))  # rev mixes the rows each device owns
        >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
        >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="dear")
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = sched(sched.init(params, tx.init(params)), batch)
        >>> any(issubclass(w.category, jaxsched.FallbackWarning) for w in caught)
        True
    """


@dataclasses.dataclass
class ShardContext:
    """What rules need: the axis, which variables are device-varying (a set: across every
    data axis; a dict: variable -> the data axes it differs across), and a warn-once log."""

    axis_name: str | tuple[str, ...]
    axis_size: int
    varying: Any = frozenset()
    reported: set = dataclasses.field(default_factory=set)
    fallbacks: list = dataclasses.field(default_factory=list)
    #: the top-level equation being run (nested calls and branches report under it)
    top: JaxprEqn | None = None
    #: every ``((primitive, source line), top-level equation)`` that fell back
    sites: list = dataclasses.field(default_factory=list)
    #: while a rule traces a body only to see what it does, what would fall back there
    probing: list | None = None
    #: where a scalar sum over devices is deferred and batched with the others
    #: (`jaxsched.core.rewrite._pending_sums`); None: each is reduced at once
    sums: Any = None

    def axes_of(self, shard: "Shard | None") -> AxisName:
        """The mesh axes ``shard``'s chunks are spread over (the data axes by default)."""
        return self.axis_name if shard is None or shard.axes is None else shard.axes

    def size_of(self, shard: "Shard | None") -> int:
        return self.axis_size if shard is None or not shard.size else shard.size

    def varies(self, x: Any, shard: "Shard | None" = None) -> bool:
        """Whether variable ``x`` differs across the devices ``shard``'s chunks are spread over."""
        if isinstance(self.varying, dict):
            across = self.varying.get(x)
            return bool(across) and bool(set(across or ()) & set(as_axes(self.axes_of(shard))))
        return x in self.varying

    def to_full(self, value: Any) -> Any:
        if isinstance(value, Shard):
            if value.full is not None:
                return value.full
            return layout.gather_chunk(value.chunk, value.shape, self.axes_of(value))
        return value

    def to_chunk(self, value: Any, shape: Sequence[int], like: "Shard | None" = None) -> jax.Array:
        """``value``'s chunk (a full value sliced locally, over ``like``'s axes)."""
        if isinstance(value, Shard):
            return value.chunk
        value = jnp.asarray(value)
        if value.ndim == 0:
            return value
        return layout.local_chunk(jnp.broadcast_to(value, shape), self.axes_of(like), self.size_of(like))

    def report(self, eqn: JaxprEqn, reason: str) -> None:
        key = (eqn.primitive.name, source_line(eqn))
        if self.probing is not None:
            self.probing.append(key)
            return
        self.sites.append((key, self.top if self.top is not None else eqn))
        if key not in self.reported:
            self.reported.add(key)
            self.fallbacks.append(key)
            warnings.warn(
                f"jaxsched: {eqn.primitive.name} at {key[1]} cannot run on shards "
                f"({reason}); its sharded operands are all-gathered and it runs on full "
                "tensors (DeAR's lazy update)",
                FallbackWarning,
                stacklevel=2,
            )


#: A shard rule: ``(context, eqn, operand values, full or `Shard`) -> result values``.
Rule = Callable[[ShardContext, JaxprEqn, list], list]

#: Elementwise primitives left to the exact fallback here, though a flat chunk of each
#: operand gives the result's chunk: no optimizer update this region was built for uses
#: them (special functions, bit counts and shifts, complex numbers), and none is tested
#: on chunks. (PRNG key operations are no flat chunks at all: `primitives.RANDOM_KEY_OPS`.)
NOT_ON_CHUNKS = frozenset(
    """
bessel_i0e bessel_i1e igamma igammac polygamma zeta clz population_count
shift_left shift_right_arithmetic shift_right_logical complex conj
""".split()
)
#: The elementwise primitives `elementwise_rule` runs on chunks.
ELEMENTWISE = primitives.ELEMENTWISE - NOT_ON_CHUNKS
RESHAPES = frozenset({"reshape", "squeeze", "expand_dims"})


def full_rule(
    ctx: ShardContext, eqn, values: list, reason: str = "no shard rule for this primitive or these shapes"
) -> list:
    """Gather what is sharded, run the primitive unchanged."""
    if any(isinstance(v, Shard) and v.full is None for v in values):
        ctx.report(eqn, reason)
    return _bind(eqn, [ctx.to_full(v) for v in values])


def elementwise_rule(ctx: ShardContext, eqn: JaxprEqn, values: list) -> list:
    shape = tuple(aval_of(eqn.outvars[0]).shape)
    shards = [v for v in values if isinstance(v, Shard)]
    if any(v.shape != shape or (v.axes, v.size) != (shards[0].axes, shards[0].size) for v in shards):
        return full_rule(ctx, eqn, values)
    like = shards[0]
    chunks = [ctx.to_chunk(v, shape, like) for v in values]
    return [like.with_chunk(out, aval_of(o).shape) for out, o in zip(_bind(eqn, chunks), eqn.outvars)]


def reshape_rule(ctx: ShardContext, eqn: JaxprEqn, values: list) -> list:
    """Row-major reshapes, and squeezing or inserting unit axes (pmap's block axis), keep
    the flat chunk; a reshape that transposes first (``dimensions``) does not."""
    value = next((v for v in values if isinstance(v, Shard)), None)
    transposes = eqn.primitive.name == "reshape" and eqn.params.get("dimensions") not in (None, ())
    if value is None or len(values) != 1 or transposes:
        return full_rule(ctx, eqn, values)
    return [value.with_chunk(value.chunk, aval_of(eqn.outvars[0]).shape)]


def broadcast_in_dim_rule(ctx: ShardContext, eqn: JaxprEqn, values: list) -> list:
    operand = values[0]
    out_shape = tuple(aval_of(eqn.outvars[0]).shape)
    if len(values) == 1 and math.prod(operand.shape) == math.prod(out_shape):
        return [operand.with_chunk(operand.chunk, out_shape)]  # only inserts unit dimensions
    return full_rule(ctx, eqn, values)


def _reduce_rule(local: Callable, collective: Callable, identity: Callable, segment: Callable | None = None) -> Rule:
    """A reduction over every axis: a local reduction of the chunk (padding masked with the
    identity) and one scalar collective. Over some axes (adafactor's row and column sums),
    with ``segment``: each chunk element added into its output position, a partial result
    the size of the output, and one collective of that size; never a gather of the input."""

    def rule(ctx: ShardContext, eqn: JaxprEqn, values: list) -> list:
        (value,) = values
        if value.full is not None:  # already whole here (a parameter gathered for forward)
            return _bind(eqn, [value.full])
        axes = tuple(sorted(eqn.params["axes"]))
        over, size = ctx.axes_of(value), ctx.size_of(value)
        mask = layout.valid_mask(value.shape, over, size)
        chunk = jnp.where(mask, value.chunk, identity(value.chunk.dtype))
        out_dtype = aval_of(eqn.outvars[0]).dtype
        if axes == tuple(range(len(value.shape))):
            if collective is lax.psum and ctx.sums is not None:
                return [ctx.sums.defer(local(chunk).astype(out_dtype), over)]
            return [collective(local(chunk).astype(out_dtype), over)]
        if segment is None:
            return full_rule(ctx, eqn, values)
        out_shape = tuple(d for k, d in enumerate(value.shape) if k not in axes)
        position = _output_position(value.shape, axes, over, size)
        partial = segment(chunk, position, num_segments=math.prod(out_shape))
        return [collective(partial.reshape(out_shape).astype(out_dtype), over)]

    return rule


def _output_position(shape: tuple[int, ...], axes: tuple[int, ...], over: Any, size: int) -> jax.Array:
    """For each element of this device's chunk (over mesh axes ``over``, ``size`` devices) of a
    tensor of ``shape``, its flat position in the result of reducing ``axes`` (padding maps
    to position 0, masked by the caller)."""
    c = layout.chunk_size(shape, size)
    flat = jnp.minimum(lax.axis_index(over) * c + jnp.arange(c), math.prod(shape) - 1)
    position = jnp.zeros_like(flat)
    for k, dim in enumerate(shape):
        if k not in axes:
            coordinate = flat // math.prod(shape[k + 1 :]) % dim
            position = position * dim + coordinate
    return position


def _all_devices(reduce: Callable) -> Callable:
    """A boolean collective through int32 (``pmin`` for all, ``pmax`` for any)."""
    return lambda x, axis_name: reduce(x.astype(jnp.int32), axis_name).astype(x.dtype)


def _lowest(dtype):
    return jnp.finfo(dtype).min if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _highest(dtype):
    return jnp.finfo(dtype).max if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max


def psum_rule(ctx: ShardContext, eqn: JaxprEqn, values: list) -> list:
    """A user's psum in the update region: of an invariant value it is a multiply by P."""
    data_axes = as_axes(ctx.axis_name)
    if not set(data_axes) <= set(_axes(eqn)) or any(ctx.varies(x) for x in eqn.invars if is_var(x)):
        return full_rule(ctx, eqn, values)
    factor = ctx.axis_size * math.prod(_axis_size(a) for a in _axes(eqn) if a not in data_axes)
    out = []
    for v in values:
        scale = lambda a: a * jnp.asarray(factor, a.dtype)
        out.append(v.with_chunk(scale(v.chunk)) if isinstance(v, Shard) else scale(v))
    return out


def identity_rule(ctx: ShardContext, eqn: JaxprEqn, values: list) -> list:
    return list(values)


def call_rule(ctx: ShardContext, eqn: JaxprEqn, values: list) -> list:
    """jit / custom_jvp / custom_vjp calls: interpret their body with the same rules."""
    inner = _inner_jaxpr(eqn)
    if inner is None:
        return full_rule(ctx, eqn, values)
    return eval_sharded(ctx, inner.jaxpr, values, constvals=inner.consts)


def cond_rule(ctx: ShardContext, eqn: JaxprEqn, values: list) -> list:
    """``lax.cond``/``lax.switch`` on a device-invariant index (``MultiSteps``' every k-th
    step, ``apply_if_finite``'s skip): every branch runs with these rules on the same chunks.
    An output that one branch returns sharded is sharded in all (a full value's chunk is a
    local slice, no traffic), so the branches agree on their types. The index is the same
    on every device, so a collective inside a branch runs on all of them or on none."""
    index, *operands = values
    if isinstance(index, Shard):
        return full_rule(ctx, eqn, values)
    shards = [v for v in operands if isinstance(v, Shard)]
    if any((v.axes, v.size) != (shards[0].axes, shards[0].size) for v in shards):
        return full_rule(ctx, eqn, values, "its operands are chunked over different axes")
    like = shards[0] if shards else None
    templates = [v if isinstance(v, Shard) else None for v in operands]
    flat = [v.chunk if isinstance(v, Shard) else v for v in operands]
    avals = [aval_of(o) for o in eqn.outvars]

    def branch(closed, sharded: Sequence[bool] | None = None, seen: list | None = None) -> Callable:
        def run(*args):
            inner = [t.with_chunk(a) if t is not None else a for a, t in zip(args, templates)]
            outs = eval_sharded(ctx, closed.jaxpr, inner, closed.consts)
            if seen is not None:  # first pass: which outputs this branch keeps sharded
                seen.append([isinstance(o, Shard) for o in outs])
                return [o.chunk if isinstance(o, Shard) else o for o in outs]
            return [
                jnp.asarray(ctx.to_chunk(o, a.shape, like) if sh else ctx.to_full(o), a.dtype)
                for o, a, sh in zip(outs, avals, sharded)
            ]

        return run

    seen: list = []
    for closed in eqn.params["branches"]:
        jax.eval_shape(branch(closed, seen=seen), *flat)
    sharded = [len(a.shape) > 0 and any(s[k] for s in seen) for k, a in enumerate(avals)]
    with at_source(eqn):
        outs = lax.switch(index, [branch(c, sharded) for c in eqn.params["branches"]], *flat)
    return [_shard_like(like, o, a.shape) if sh else o for o, a, sh in zip(outs, avals, sharded)]


def _shard_like(like: "Shard | None", chunk: jax.Array, shape: Sequence[int]) -> Shard:
    """A chunk over ``like``'s axes (the data axes without one)."""
    return like.with_chunk(chunk, shape) if like is not None else Shard(chunk, tuple(shape))


def scan_rule(ctx: ShardContext, eqn: JaxprEqn, values: list) -> list:
    """``lax.scan`` (and ``fori_loop`` with static bounds) whose scanned inputs are full:
    the body runs with these rules, sharded carries stay sharded. Which carries are
    sharded is found by tracing the body until it agrees with itself: a carry that comes
    out sharded starts sharded (its initial value sliced locally); one the body needs
    whole (muon's Newton-Schulz matmuls) is gathered once, before the loop, not in every
    iteration. Scanned inputs that are shards, and per-iteration outputs that come out
    sharded, are no chunk of one tensor per iteration: the former fall back, the latter
    are gathered; both say so."""
    p = eqn.params
    nc, nk = scan_counts(p)
    consts, init, xs = values[:nc], values[nc : nc + nk], values[nc + nk :]
    if any(isinstance(v, Shard) for v in xs) or p.get("_split_transpose"):
        return full_rule(ctx, eqn, values)
    closed = p["jaxpr"]
    carry_avals = [v.aval for v in closed.jaxpr.invars[nc : nc + nk]]
    kinds = [isinstance(v, Shard) and len(a.shape) > 0 for v, a in zip(init, carry_avals)]
    shards = [v for v in list(consts) + list(init) if isinstance(v, Shard)]
    if any((v.axes, v.size) != (shards[0].axes, shards[0].size) for v in shards):
        return full_rule(ctx, eqn, values, "its operands are chunked over different axes")
    like = shards[0] if shards else None

    def body(kinds: Sequence[bool], seen: list | None = None) -> Callable:
        def run(carry, x):
            inner = [_shard_like(like, c, a.shape) if k else c for c, a, k in zip(carry, carry_avals, kinds)]
            outs = eval_sharded(ctx, closed.jaxpr, list(consts) + inner + list(x), closed.consts)
            new, ys = outs[:nk], outs[nk:]
            if seen is not None:
                seen.append([isinstance(o, Shard) for o in new])
            if any(isinstance(y, Shard) and y.full is None for y in ys):
                ctx.report(eqn, "a per-iteration output is sharded")
            new = [
                jnp.asarray(ctx.to_chunk(o, a.shape, like) if k else ctx.to_full(o), a.dtype)
                for o, a, k in zip(new, carry_avals, kinds)
            ]
            return new, [ctx.to_full(y) for y in ys]

        return run

    def start(kinds: Sequence[bool], final: bool = False) -> list:
        if final and any(isinstance(v, Shard) and v.full is None and not k for v, k in zip(init, kinds)):
            ctx.report(eqn, "the loop body needs a sharded carry whole")
        return [
            jnp.asarray(ctx.to_chunk(v, a.shape, like) if k else ctx.to_full(v), a.dtype)
            for v, a, k in zip(init, carry_avals, kinds)
        ]

    x_slice = [jax.ShapeDtypeStruct(tuple(np.shape(x))[1:], jnp.result_type(x)) for x in xs]
    dropped: set = set()
    probe, ctx.probing = ctx.probing, []
    try:
        for _ in range(2 * nk + 1):  # a carry is sharded at most once and dropped at most once
            seen: list = []
            jax.eval_shape(body(kinds, seen), start(kinds), x_slice)
            agreed = []
            for k, (was, now, a) in enumerate(zip(kinds, seen[0], carry_avals)):
                if was and not now:
                    dropped.add(k)
                agreed.append(now and k not in dropped and len(a.shape) > 0)
            if agreed == kinds:
                break
            kinds = agreed
        inside = ctx.probing
    finally:
        ctx.probing = probe
    if inside:  # the body gathers something in every iteration: gather it once, before
        return full_rule(ctx, eqn, values, f"its body needs a sharded value whole ({inside[0][0]} at {inside[0][1]})")
    init_values = start(kinds, final=True)
    with at_source(eqn):
        carry, ys = lax.scan(
            body(kinds), init_values, list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
        )
    return [_shard_like(like, c, a.shape) if k else c for c, a, k in zip(carry, carry_avals, kinds)] + list(ys)


def _axes(eqn: JaxprEqn) -> tuple:
    axes = eqn.params.get("axes", ())
    return axes if isinstance(axes, tuple) else (axes,)


def _axis_size(name) -> int:
    return lax.axis_size(name)


def defelementwise(table: dict[str, Rule], names: Iterable[str]) -> None:
    """Run each of ``names`` on chunks by `elementwise_rule`."""
    table.update(dict.fromkeys(names, elementwise_rule))


def defreducer(
    table: dict[str, Rule],
    name: str,
    local: Callable,
    collective: Callable,
    identity: Callable,
    segment: Callable | None = None,
) -> None:
    """Run array reduction ``name`` on chunks: ``local`` on the chunk (its padding set to
    ``identity(dtype)``), then ``collective``; over some axes, ``segment`` (None: fall back)."""
    table[name] = _reduce_rule(local, collective, identity, segment)


#: Array reductions run on chunks: ``(local, collective, identity, segment)``; the others
#: (``reduce_prod``, ``reduce_xor``) fall back.
REDUCERS: dict[str, tuple[Callable, Callable, Callable, Callable | None]] = {
    "reduce_sum": (jnp.sum, lax.psum, lambda d: jnp.zeros((), d), jax.ops.segment_sum),
    "reduce_max": (jnp.max, lax.pmax, lambda d: jnp.asarray(_lowest(d), d), jax.ops.segment_max),
    "reduce_min": (jnp.min, lax.pmin, lambda d: jnp.asarray(_highest(d), d), jax.ops.segment_min),
    # the finite checks of loss scaling (DynamicScale, apply_if_finite) and zero_nans
    "reduce_and": (jnp.all, _all_devices(lax.pmin), lambda d: jnp.ones((), d), None),
    "reduce_or": (jnp.any, _all_devices(lax.pmax), lambda d: jnp.zeros((), d), None),
}


def _build() -> dict[str, Rule]:
    table: dict[str, Rule] = {}
    defelementwise(table, ELEMENTWISE)
    table.update(dict.fromkeys(RESHAPES, reshape_rule))
    table["broadcast_in_dim"] = broadcast_in_dim_rule
    for name in sorted(primitives.ARRAY_REDUCTIONS & REDUCERS.keys()):
        defreducer(table, name, *REDUCERS[name])
    table.update(dict.fromkeys(primitives.SUM_REDUCTIONS, psum_rule))
    table["cond"] = cond_rule
    table["scan"] = scan_rule
    table.update(dict.fromkeys(VMA_TYPING, identity_rule))
    table.update(dict.fromkeys(CALL_PRIMITIVES, call_rule))
    return table


#: The shard rule of each primitive; the others fall back (`full_rule`).
RULES: dict[str, Rule] = _build()


def apply_rule(ctx: ShardContext, eqn: JaxprEqn, values: list) -> list:
    """Run one equation: unchanged if nothing is sharded, else by its rule."""
    shards = [v for v in values if isinstance(v, Shard)]
    if not shards:
        return _bind(eqn, values)
    varying = [x for x in eqn.invars if is_var(x) and any(ctx.varies(x, shard) for shard in shards)]
    # a conditional on an index every device agrees on is judged inside its branches
    judged_whole = eqn.primitive.name != "cond" or any(x is eqn.invars[0] for x in varying)
    if varying and judged_whole:
        # Chunks of device-varying tensors are not chunks of one tensor: stay exact. A
        # conditional's branches are judged equation by equation (`cond_rule`): the analysis
        # follows the variation into them, so a parameter block beside a chunk passes
        # through untouched, and only what combines the two falls back.
        return full_rule(ctx, eqn, values)
    return RULES.get(eqn.primitive.name, full_rule)(ctx, eqn, values)


def eval_sharded(ctx: ShardContext, jaxpr, args: Sequence[Any], constvals: Sequence[Any] = ()) -> list:
    """Evaluate ``jaxpr`` with some inputs sharded; returns full arrays or `Shard`."""
    return eval_inline(jaxpr, constvals, args, run=lambda eqn, values: apply_rule(ctx, eqn, values))
