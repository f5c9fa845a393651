"""Rules for parameter blocks: what the optimizer runs on an FSDP parameter, kept a block.

A parameter (or optimizer-state leaf) sharded over data axes enters the per-device program as
its block (`block`). Forward and backward read it through
rules that do not know blocks, so the interpreter gathers it first: FSDP's all-gather before
use. The update reads it through the rules here, which keep it a block:

* **elementwise** operations run on blocks; a replicated operand is sliced to the same block
  (no traffic) and a gradient that is still a partial sum over the data axes is
  reduce-scattered into it (the gradient reduction of an FSDP parameter);
* **reductions** over the block's dimension become a local reduction and a partial sum over
  the block's axes (a global norm), or a ``pmax``/``pmin`` over them;
* **shape** operations that keep the block's dimension whole keep the block (reshapes,
  transposes, broadcasts, slices along other dimensions).

So that a gradient is reduce-scattered rather than all-reduced and sliced, planning first
marks which values will meet a block (`block_hints`, from the outputs back through
elementwise operations): an elementwise operation on those is planned as a block too.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxsched.core.partition._interpreter import Partitioner
    >>> from jaxsched.core.partition._kinds import AxisContext, PARTIAL, block
    >>> from jaxsched.core.partition._table import TABLE
    >>> step = lambda w, g: w - 0.1 * g  # an SGD update of a block from a gradient sum
    >>> closed = jax.make_jaxpr(step)(jnp.ones((8, 3)), jnp.ones((8, 3)))
    >>> ctx = AxisContext("fsdp", 4, (("fsdp", 4),))
    >>> plan = Partitioner(ctx, TABLE).plan(closed.jaxpr, [block(0, "fsdp"), PARTIAL], [block(0, "fsdp")])
    >>> [p.inputs for p in plan.eqns]  # the scaled sum is reduce-scattered into the block
    [(R, Pt), (B(0:fsdp), B(0:fsdp))]
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.extend.core import JaxprEqn

from jaxsched.core import _primitives as primitives
from jaxsched.core.partition import _forward_rules as rules
from jaxsched.core.partition._control_flow import CONTROL_RULES, is_call
from jaxsched.core.partition._interpreter import EqnPlan, Partitioner, Rule
from jaxsched.core.partition._kinds import Kind, REPLICATED
from jaxsched.core.partition._forward_rules import _plan, _shape, bind_local

__all__ = ["BLOCK_RULES", "block_hints", "block_rule_for"]


def _gathered(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    """The equation's own rule on whole values: blocks gathered, partial sums summed."""
    return rules.rule_for(eqn)(p, eqn, [REPLICATED if k.is_special else k for k in kinds], single)


def _target(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind]) -> Kind | None:
    """The block an elementwise equation runs on: that of a block operand, or of a hint on
    its result or on one of its operands; None when there is none or they disagree."""
    found = {k for k in kinds if k.is_block}
    hints = getattr(p, "hints", {})
    for x in list(eqn.outvars) + [x for x in eqn.invars if isinstance(x, jex_core.Var)]:
        if x in hints:
            found.add(hints[x])
    return found.pop() if len(found) == 1 else None


def elementwise_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    out_shape = _shape(eqn.outvars[0])
    if any(k.dim is not None and k.over is None for k in kinds):
        return _gathered(p, eqn, kinds, single)  # beside the batch's blocks: gather the parameter
    if not any(k.is_special for k in kinds):  # reached through a hint only
        linear = any(k.partial for k in kinds) and rules._linear_positions(p, eqn, kinds, single) is not None
        if linear or all(k.is_replicated for k in kinds):
            # a partial sum whose only use is linear stays one, to be reduce-scattered once
            # where it meets the block; replicated values stay whole for their other readers
            return rules.rule_for(eqn)(p, eqn, kinds, single)
    target = _target(p, eqn, kinds)
    if target is None or target.split >= len(out_shape):
        if any(k.is_block for k in kinds):
            return _gathered(p, eqn, kinds, single)
        if not any(k.is_special for k in kinds):
            return rules.rule_for(eqn)(p, eqn, kinds, single)
        return _partial_elementwise(p, eqn, kinds, single)
    d = target.split
    wanted = [
        target if len(_shape(x)) == len(out_shape) and _shape(x)[d] == out_shape[d] else REPLICATED for x in eqn.invars
    ]
    outs = [target if len(_shape(o)) > d and _shape(o)[d] == out_shape[d] else REPLICATED for o in eqn.outvars]
    return _plan(eqn, wanted, outs)


def _partial_elementwise(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    """No block in sight, a partial sum over some data axes: it stays one through linear
    operations where it is their only use (a global norm's terms add up unreduced)."""
    partials = {k for k in kinds if k.partial}
    positions = rules._linear_positions(p, eqn, kinds, single) if len(partials) == 1 else None
    if positions is None:
        return _gathered(p, eqn, kinds, single)
    (common,) = partials
    wanted = [common if k == rules.PARTIAL else k for k in rules._partial_inputs(p, eqn, kinds, positions)]
    return _plan(eqn, wanted, [common] * len(eqn.outvars))


def _reduce_rule(finish: str | None) -> Rule:
    """``reduce_*`` of a block: over its dimension a local reduction, then a partial sum over
    its axes (``finish`` None) or a ``pmax``/``pmin`` of the local result; over other
    dimensions the block stays one."""

    def rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
        (k,) = kinds
        axes = tuple(eqn.params["axes"])
        if k.partial:
            if finish is None and single[0]:
                return _plan(eqn, [k], [k])
            return _plan(eqn, [REPLICATED], [REPLICATED])
        if k.split not in axes:
            return _plan(eqn, [k], [k.moved(k.split - sum(1 for a in axes if a < k.split))])
        if finish is None:
            return _plan(eqn, [k], [p.ctx.normalized(Kind(partial=True, over=k.over))])
        collective = {"pmax": lax.pmax, "pmin": lax.pmin}[finish]
        over = tuple(k.over or ())

        def emit(values: list) -> list:
            (local,) = bind_local(eqn, values)
            if local.dtype == bool:
                return [collective(local.astype("int32"), over).astype(bool)]
            return [collective(local, over)]

        return _plan(eqn, [k], [REPLICATED], emit)

    return rule


def _keep_dim(
    p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool], new_dim: int | None, emit=None
) -> EqnPlan:
    """A one-operand shape operation: the block moves to ``new_dim`` (None: it cannot stay a
    block); a partial sum goes through where this is its only use."""
    k = kinds[0]
    rest = [REPLICATED] * (len(kinds) - 1)
    if k.partial:
        kind = k if single[0] and all(r.is_replicated for r in kinds[1:]) else REPLICATED
        return _plan(eqn, [kind] + rest, [kind] * len(eqn.outvars))
    if new_dim is None or any(r.is_special for r in kinds[1:]):
        return _gathered(p, eqn, kinds, single)
    return _plan(eqn, [k] + rest, [k.moved(new_dim)] * len(eqn.outvars), emit)


def broadcast_in_dim_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    k = kinds[0]
    shape = tuple(eqn.params["shape"])
    dims = tuple(eqn.params["broadcast_dimensions"])
    if len(kinds) != 1 or not k.is_block:
        return _keep_dim(p, eqn, kinds, single, None)
    if _shape(eqn.invars[0])[k.split] != shape[dims[k.split]]:
        return _gathered(p, eqn, kinds, single)
    e = dims[k.split]
    size = p.ctx.split_size(k)
    local = shape[:e] + (shape[e] // size,) + shape[e + 1 :]
    return _keep_dim(p, eqn, kinds, single, e, lambda v: bind_local(eqn, v, shape=local))


def reshape_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    k = kinds[0]
    out_shape = _shape(eqn.outvars[0])
    if len(kinds) != 1 or eqn.params.get("dimensions") not in (None, ()) or not k.is_block:
        return _keep_dim(p, eqn, kinds, single, None if not k.partial else 0)
    size = p.ctx.split_size(k)
    e = rules.reshaped_dim(_shape(eqn.invars[0]), out_shape, k.split, size)
    if e is None:
        return _gathered(p, eqn, kinds, single)
    local = out_shape[:e] + (out_shape[e] // size,) + out_shape[e + 1 :]
    if eqn.primitive.name == "reshape":
        return _keep_dim(p, eqn, kinds, single, e, lambda v: bind_local(eqn, v, new_sizes=local))
    return _keep_dim(p, eqn, kinds, single, e, lambda v: [lax.reshape(v[0], local)])


def transpose_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    k = kinds[0]
    new = tuple(eqn.params["permutation"]).index(k.split) if k.is_block else None
    return _keep_dim(p, eqn, kinds, single, new)


def squeeze_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    k = kinds[0]
    dims = tuple(eqn.params["dimensions"])
    new = k.split - sum(1 for a in dims if a < k.split) if k.is_block and k.dim not in dims else None
    return _keep_dim(p, eqn, kinds, single, new)


def dynamic_slice_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    """A slice along other dimensions (a layer of a stacked block) keeps the block."""
    k = kinds[0]
    shape = _shape(eqn.invars[0])
    sizes = tuple(eqn.params["slice_sizes"])
    if not k.is_block or sizes[k.split] != shape[k.split]:
        return _keep_dim(p, eqn, kinds, single, None)
    local = sizes[: k.split] + (shape[k.split] // p.ctx.split_size(k),) + sizes[k.split + 1 :]
    return _keep_dim(p, eqn, kinds, single, k.split, lambda v: bind_local(eqn, v, slice_sizes=local))


def slice_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    k = kinds[0]
    shape = _shape(eqn.invars[0])
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params["strides"] or (1,) * len(shape)
    if not k.is_block or (start[k.split], limit[k.split], strides[k.split]) != (0, shape[k.split], 1):
        return _keep_dim(p, eqn, kinds, single, None)
    local = tuple(limit)[: k.split] + (shape[k.split] // p.ctx.split_size(k),) + tuple(limit)[k.split + 1 :]
    return _keep_dim(p, eqn, kinds, single, k.split, lambda v: bind_local(eqn, v, limit_indices=local))


def identity_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    return rules.identity_rule(p, eqn, kinds, single)


#: Array reductions over a block's dimension, by the collective that combines the local
#: results (None: they stay a partial sum over the block's axes).
REDUCER_COLLECTIVE: dict[str, str | None] = {
    "reduce_sum": None,
    "reduce_max": "pmax",
    "reduce_min": "pmin",
    "reduce_and": "pmin",
    "reduce_or": "pmax",
}


def _build() -> dict[str, Rule]:
    table: dict[str, Rule] = {}
    table.update(dict.fromkeys(primitives.ELEMENTWISE, elementwise_rule))
    for name in sorted(primitives.ARRAY_REDUCTIONS & REDUCER_COLLECTIVE.keys()):
        table[name] = _reduce_rule(REDUCER_COLLECTIVE[name])
    table.update(dict.fromkeys(primitives.PLACEMENT | primitives.VMA_TYPING, identity_rule))
    table.update(
        {
            "broadcast_in_dim": broadcast_in_dim_rule,
            "reshape": reshape_rule,
            "expand_dims": reshape_rule,
            "transpose": transpose_rule,
            "squeeze": squeeze_rule,
            "dynamic_slice": dynamic_slice_rule,
            "slice": slice_rule,
        }
    )
    return table


#: Rules for equations that read a block or a partial sum over some data axes, by primitive.
BLOCK_RULES: dict[str, Rule] = _build()


def block_rule_for(eqn: JaxprEqn) -> Rule | None:
    """The block rule of ``eqn``; calls and control flow plan their bodies with the blocks as
    they are; None: the operands are gathered first."""
    name = eqn.primitive.name
    if name in BLOCK_RULES:
        return BLOCK_RULES[name]
    if name in CONTROL_RULES:
        return CONTROL_RULES[name]
    if is_call(eqn):
        return rules.rule_for(eqn)
    return None


def block_hints(jaxpr, out_kinds: Sequence[Kind] | None) -> dict:
    """Which values will meet a parameter block of the outputs: from each output wanted as a
    block back through the elementwise equations that compute it, every full-shaped operand
    is marked with that block (two different blocks: unmarked)."""
    hints: dict = {}
    conflicting: set = set()

    def mark(x: jex_core.Var | jex_core.Literal, kind: Kind) -> None:
        if not isinstance(x, jex_core.Var) or x in conflicting:
            return
        if x in hints and hints[x] != kind:
            conflicting.add(x)
            del hints[x]
            return
        hints[x] = kind

    if out_kinds is None:
        return hints
    for x, k in zip(jaxpr.outvars, out_kinds):
        if k.is_block:
            mark(x, k)
    for eqn in reversed(jaxpr.eqns):
        marked = [hints[o] for o in eqn.outvars if o in hints]
        if len(marked) != 1:
            continue
        kind = marked[0]
        out_shape = _shape(eqn.outvars[0])
        name = eqn.primitive.name
        if name in BLOCK_RULES and BLOCK_RULES[name] is elementwise_rule:
            for x in eqn.invars:
                shape = tuple(x.aval.shape)
                if len(shape) == len(out_shape) and kind.dim < len(shape) and shape[kind.dim] == out_shape[kind.dim]:
                    mark(x, kind)
        elif name in HINT_THROUGH:
            # a layer's gradient padded, reshaped or transposed into a stacked one: the
            # layer's gradient meets the block too (reduce-scattered in its own layer)
            moved = HINT_THROUGH[name](eqn, kind.dim)
            if moved is not None:
                mark(eqn.invars[0], kind.moved(moved))
    return hints


def _through_pad(eqn: JaxprEqn, d: int) -> int | None:
    config = eqn.params["padding_config"]
    return d if tuple(config[d]) == (0, 0, 0) else None


def _through_reshape(eqn: JaxprEqn, d: int) -> int | None:
    if eqn.params.get("dimensions") not in (None, ()):
        return None
    in_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    # the operand dimension that carries output dimension d whole (unit dimensions aside)
    prefix = int(np.prod(out_shape[:d]))
    acc = 1
    for e, size in enumerate(in_shape):
        if acc == prefix and size == out_shape[d]:
            return e
        acc *= size
    return None


def _through_broadcast(eqn: JaxprEqn, d: int) -> int | None:
    dims = tuple(eqn.params["broadcast_dimensions"])
    if d not in dims or len(eqn.invars) != 1:
        return None
    e = dims.index(d)
    return e if _shape(eqn.invars[0])[e] == _shape(eqn.outvars[0])[d] else None


#: Shape operations a hint passes back through: output dimension -> operand dimension.
HINT_THROUGH: dict[str, Callable[[JaxprEqn, int], int | None]] = {
    "pad": _through_pad,
    "reshape": _through_reshape,
    "expand_dims": _through_reshape,
    "squeeze": _through_reshape,
    "broadcast_in_dim": _through_broadcast,
    "transpose": lambda eqn, d: tuple(eqn.params["permutation"])[d],
}


def pad_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    """A layer's gradient padded into a stacked gradient that meets a stacked block: the
    layer's gradient is reduce-scattered into its block first, then padded locally."""
    k, value = kinds
    hint = p.hints.get(eqn.outvars[0])
    config = eqn.params["padding_config"]
    target = hint if hint is not None and hint.is_block else (k if k.is_block else None)
    if target is None or tuple(config[target.dim]) != (0, 0, 0) or value.is_special:
        return _gathered(p, eqn, kinds, single)
    if k.dim is not None and k.over is None:  # the batch's block
        return _gathered(p, eqn, kinds, single)
    return _plan(eqn, [target, REPLICATED], [target])


BLOCK_RULES["pad"] = pad_rule
