"""Narrowing rules: how a replicated producer computes only the block its readers want.

A value computed whole on every device (a mask broadcast to the batch's shape, an ``iota``,
random bits drawn from one key) that is read only as this device's block of dimension
``d`` need not be computed whole: its narrowing rule plans the producer to compute that
block alone, asking its operands for their blocks in turn. A rule returns None when it
cannot; primitives without a narrowing rule of their own try their forward rule
(`jaxsched.core.partition._forward_rules`) on some operand held as a block
(`narrow_by_search`).

Example:
    >>> import jax.numpy as jnp
    >>> from jax import make_jaxpr
    >>> eqn = make_jaxpr(lambda a: jnp.sin(a))(jnp.ones(2)).jaxpr.eqns[0]
    >>> narrow_rule_for(eqn) is NARROW["sin"]
    True
"""

from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import JaxprEqn

from jaxsched.core import _primitives as primitives
from jaxsched.core.partition._forward_rules import RULES, _aval, _plan, _shape, bind_local, identity_rule
from jaxsched.core.partition._interpreter import EqnPlan, NarrowRule, Partitioner
from jaxsched.core.partition._kinds import REPLICATED, local_shape, sharded

__all__ = [
    "NARROW",
    "NARROWABLE_ELEMENTWISE",
    "NarrowRule",
    "defnarrow_elementwise",
    "narrow_by_search",
    "narrow_rule_for",
]

#: Elementwise primitives whose operands and result share a shape (random keys do not).
NARROWABLE_ELEMENTWISE = primitives.ELEMENTWISE


def _narrow_elementwise(p: Partitioner, eqn: JaxprEqn, d: int) -> EqnPlan | None:
    out_shape = _shape(eqn.outvars[0])
    if not p.ctx.can_shard(out_shape, d):
        return None
    wanted = [
        sharded(d) if len(_shape(x)) == len(out_shape) and _shape(x)[d] == out_shape[d] else REPLICATED
        for x in eqn.invars
    ]
    return _plan(eqn, wanted, [sharded(d)])


def _narrow_bitcast(p: Partitioner, eqn: JaxprEqn, d: int) -> EqnPlan | None:
    if _shape(eqn.invars[0]) != _shape(eqn.outvars[0]):
        return None
    return _narrow_elementwise(p, eqn, d)


def _narrow_broadcast(p: Partitioner, eqn: JaxprEqn, d: int) -> EqnPlan | None:
    shape = tuple(eqn.params["shape"])
    if len(eqn.invars) != 1 or not p.ctx.can_shard(shape, d):
        return None
    dims = tuple(eqn.params["broadcast_dimensions"])
    operand = REPLICATED
    if d in dims and _shape(eqn.invars[0])[dims.index(d)] == shape[d]:
        operand = sharded(dims.index(d))
    local = local_shape(shape, sharded(d), p.ctx.axis_size)
    return _plan(eqn, [operand], [sharded(d)], lambda v: bind_local(eqn, v, shape=local))


def _narrow_iota(p: Partitioner, eqn: JaxprEqn, d: int) -> EqnPlan | None:
    shape = tuple(eqn.params["shape"])
    if not p.ctx.can_shard(shape, d):
        return None
    local = local_shape(shape, sharded(d), p.ctx.axis_size)
    along = eqn.params["dimension"] == d

    def emit(values: list) -> list:
        (out,) = bind_local(eqn, values, shape=local)
        if along:  # this block's positions along d start at its offset
            out = out + (p.ctx.index() * local[d]).astype(out.dtype)
        return [out]

    return _plan(eqn, [], [sharded(d)], emit)


def _narrow_random_bits(p: Partitioner, eqn: JaxprEqn, d: int) -> EqnPlan | None:
    """One key's bits for this device's block, by the counter layout of JAX's partitionable
    threefry (``jax_threefry_partitionable``): the element at global linear index ``n`` is
    hashed from counter ``n``, so a block hashes its own counters, as XLA's partitioner does."""
    from jax.extend.random import threefry2x32_p

    key = _aval(eqn.invars[0])
    shape = tuple(eqn.params["shape"])
    bit_width = eqn.params["bit_width"]
    if (
        key.shape != ()
        or not jax.config.jax_threefry_partitionable  # type: ignore[attr-defined]
        or not p.ctx.can_shard(shape, d)
        or bit_width not in (8, 16, 32, 64)
        or int(np.prod(shape)) >= 2**32
    ):
        return None
    if getattr(getattr(key.dtype, "_impl", None), "name", None) != "threefry2x32":
        return None  # another PRNG (rbg): its bits do not follow this counter layout
    local = local_shape(shape, sharded(d), p.ctx.axis_size)
    strides = [int(np.prod(shape[k + 1 :])) for k in range(len(shape))]

    def emit(values: list) -> list:
        data = jax.random.key_data(values[0])
        counts = jnp.zeros(local, jnp.uint32)
        for k, stride in enumerate(strides):
            counts = counts + lax.broadcasted_iota(jnp.uint32, local, k) * jnp.uint32(stride)
        counts = counts + (p.ctx.index() * local[d] * strides[d]).astype(jnp.uint32)
        bits1, bits2 = threefry2x32_p.bind(data[0], data[1], jnp.zeros(local, jnp.uint32), counts)
        if bit_width == 64:
            wide = jnp.uint64
            return [lax.shift_left(bits1.astype(wide), wide(32)) | bits2.astype(wide)]
        out = bits1 ^ bits2
        return [out if bit_width == 32 else out.astype({8: jnp.uint8, 16: jnp.uint16}[bit_width])]

    return _plan(eqn, [REPLICATED], [sharded(d)], emit)


def defnarrow_elementwise(table: dict[str, NarrowRule], names: Iterable[str]) -> None:
    """Narrow each of ``names`` as an elementwise operation: block ``d`` of each full-shaped
    operand."""
    table.update(dict.fromkeys(names, _narrow_elementwise))


def _build() -> dict[str, NarrowRule]:
    table: dict[str, NarrowRule] = {}
    defnarrow_elementwise(table, NARROWABLE_ELEMENTWISE)
    table.update(
        {
            "bitcast_convert_type": _narrow_bitcast,
            "broadcast_in_dim": _narrow_broadcast,
            "iota": _narrow_iota,
            "random_bits": _narrow_random_bits,
        }
    )
    return table


#: The narrowing rules of their own, by primitive (the others: `narrow_rule_for`).
NARROW: dict[str, NarrowRule] = _build()


def _narrow_by_search(p: Partitioner, eqn: JaxprEqn, d: int) -> EqnPlan | None:
    """The plan of ``eqn``'s own rule for some operand held as a block, if that plan yields
    block ``d`` of the result: a scatter's or a reshape's inverse, found by asking forward."""
    rule = RULES[eqn.primitive.name]
    n = len(eqn.invars)
    p.trying = True
    try:
        for i, x in enumerate(eqn.invars):
            shape = _shape(x)
            for e in range(len(shape)):
                if not p.ctx.can_shard(shape, e):
                    continue
                kinds = [REPLICATED] * n
                kinds[i] = sharded(e)
                plan = rule(p, eqn, kinds, [False] * n)
                if plan.outputs == (sharded(d),) and not any(k.partial for k in plan.inputs):
                    return plan
    finally:
        p.trying = False
    return None


narrow_by_search: NarrowRule = _narrow_by_search


def narrow_rule_for(eqn: JaxprEqn) -> NarrowRule | None:
    """How ``eqn`` computes only a block of its result (None: it cannot): its own narrowing
    rule, else its forward rule searched (`narrow_by_search`) unless that rule passes values
    through (placement annotations), works on keys, or is a ``shard_map``'s."""
    name = eqn.primitive.name
    if name in NARROW:
        return NARROW[name]
    if (
        name in RULES
        and RULES[name] is not identity_rule
        and name not in primitives.RANDOM_KEY_OPS
        and name != "shard_map"
    ):
        return _narrow_by_search
    return None
