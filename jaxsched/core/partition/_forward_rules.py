"""Forward rules, one per primitive: which kinds it needs of its operands, which kinds its results have.

A rule receives the equation, the current `Kind` of each
operand and, per operand, whether this equation is the variable's only use; it returns an
`EqnPlan`. The families, as JAX's batching rules
track a batched dimension:

* **elementwise** operations keep the sharded dimension; replicated operands are sliced to
  the same block locally, without communication;
* **shape** operations (reshape, transpose, broadcast, slice, pad, concatenate, ...) move
  the sharded dimension, or gather when they cut across it;
* a **reduction or contraction over** the sharded dimension becomes a local one whose
  result is a partial sum (``reduce_sum``, ``dot_general``, a convolution's kernel
  gradient, a scatter-add of per-example rows) or is reduced at once (``pmax`` for
  ``reduce_max``, ``pmin`` for ``reduce_and``);
* **linear** operations keep a partial sum unreduced when they are its only use, so each
  gradient is summed once, where it is complete;
* **calls** are inlined, **loops and conditionals** are planned to a fixed point
  (`jaxsched.core.partition._control_flow`);
* anything else that meets a sharded operand gathers it (`GatherWarning`) and runs
  on the whole batch: exact, never a wrong number.

The table is filled by one registrar per family (`defelementwise`, `defreducer`, ...) from
the families of `jaxsched.core._primitives`, as JAX's ``batching.defvectorized`` fills its
batching rules.

Example:
    >>> "dot_general" in RULES and "scan" not in RULES  # loops: control_flow.CONTROL_RULES
    True
    >>> RULES["mul"] is RULES["add"] is elementwise_rule
    True
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import source_info_util
from jax.extend.core import JaxprEqn, Literal, Var
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jax.typing import ArrayLike

from jaxsched.core import _primitives as primitives
from jaxsched.core.partition._control_flow import CONTROL_RULES, call_rule, is_call
from jaxsched.core.partition._interpreter import EqnPlan, Partitioner, Rule, aval_of
from jaxsched.core.partition._kinds import AxisContext, Kind, PARTIAL, REPLICATED, local_shape, sharded
from jaxsched.core._replay import eval_inline

__all__ = [
    "ELEMENTWISE",
    "Finish",
    "RULES",
    "Rule",
    "RuleDict",
    "bind_local",
    "defalong",
    "defelementwise",
    "defreducer",
    "defshared",
    "deftrailing",
    "elementwise_rule",
    "identity_rule",
    "moving_rule",
    "replicated_rule",
    "reshaped_dim",
    "rule_for",
]

#: An operand of an equation: a variable or a literal.
Atom = Var | Literal
#: A forward rule table, by primitive name.
RuleDict = dict[str, Rule]
#: How a reduction's local results are combined across devices: ``(partitioner, local) -> whole``.
Finish = Callable[[Partitioner, jax.Array], jax.Array]

#: Parameters that place a result on a mesh: meaningless per device, so dropped.
SHARDING_PARAMS = ("sharding", "out_sharding")


def local_sharding(sharding: object) -> NamedSharding | None:
    """A placement parameter as it reads inside the per-device body: on an ``Explicit`` mesh
    whose model axes the body leaves to XLA, its spec on those axes (the data axes are manual
    there); None everywhere else, where per device it places nothing."""
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    free = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}
    if not free:
        return None
    entries = []
    for entry in spec:
        axes = () if entry is None else tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in free)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries))


def bind_local(eqn: JaxprEqn, values: Sequence[ArrayLike], **updates: object) -> list[jax.Array]:
    """Bind ``eqn``'s primitive on local values, its placement parameters restricted to the
    body's model axes (`local_sharding`) and ``updates`` (local shapes) applied, at the
    user's source line."""
    params = dict(eqn.params)
    for name in SHARDING_PARAMS:
        if name in params:
            params[name] = local_sharding(params[name])
    params.update(updates)
    # the user's source line, not the equation's context: that holds the global (Explicit)
    # mesh, and these equations run inside the per-device body's manual one
    with source_info_util.user_context(
        eqn.source_info.traceback, name_stack=source_info_util.current_name_stack() + eqn.source_info.name_stack
    ):
        out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _plan(
    eqn: JaxprEqn,
    inputs: Sequence[Kind],
    outputs: Sequence[Kind],
    emit: Callable[[list], Sequence[ArrayLike]] | None = None,
) -> EqnPlan:
    return EqnPlan(tuple(inputs), tuple(outputs), emit or (lambda values: bind_local(eqn, values)))


_aval = aval_of


def _shape(x: Atom) -> tuple[int, ...]:
    return tuple(_aval(x).shape)


def replicated_rule(
    p: Partitioner,
    eqn: JaxprEqn,
    kinds: list[Kind],
    single: list[bool],
    why: str = "has no per-device rule for a batch-sharded operand",
) -> EqnPlan:
    """Run on whole values: gather blocks, reduce partial sums (the exact fallback)."""
    if any(k.dim is not None for k in kinds):
        p.gathered(eqn, why)
    return _plan(eqn, [REPLICATED] * len(kinds), [REPLICATED] * len(eqn.outvars))


def _all_replicated(kinds: list[Kind]) -> bool:
    return all(k.is_replicated for k in kinds)


def _partial_ok(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool], positions: Sequence[int]) -> bool:
    """Whether the operands at ``positions`` may stay partial sums: each is one already (and
    this is its only use) or a known zero."""
    return all((kinds[i].partial and single[i]) or p.is_zero(eqn.invars[i]) for i in positions)


def _partial_inputs(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], positions: Sequence[int]) -> list:
    """Input kinds for a linear plan: partial at ``positions`` (a zero stays as it is),
    replicated elsewhere."""
    wanted = []
    for i, k in enumerate(kinds):
        if i in positions and not (p.is_zero(eqn.invars[i]) and not k.partial):
            wanted.append(PARTIAL)
        else:
            wanted.append(REPLICATED if i not in positions else k)
    return wanted


# -- elementwise --------------------------------------------------------------------------
#: What `elementwise_rule` plans: elementwise math, and the PRNG key operations (a batch of
#: keys keeps its blocks; they are not narrowed, `jaxsched.core.partition._narrowing_rules`).
ELEMENTWISE = primitives.ELEMENTWISE | primitives.RANDOM_KEY_OPS

#: Elementwise primitives linear in the operands at these positions (the others must be
#: replicated): a partial sum goes through them unreduced.
LINEAR_IN: dict[str, Callable[[int], tuple]] = {
    "add": lambda n: tuple(range(n)),
    "add_any": lambda n: tuple(range(n)),
    "sub": lambda n: tuple(range(n)),
    "neg": lambda n: (0,),
    "copy": lambda n: (0,),
    "copy_p": lambda n: (0,),
    "real": lambda n: (0,),
    "imag": lambda n: (0,),
    "complex": lambda n: tuple(range(n)),  # re + i im: a sum of complex terms, both parts summed
    "conj": lambda n: (0,),
}


def _linear_positions(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> tuple | None:
    """Operand positions through which this elementwise equation carries a partial sum, or
    None if it cannot."""
    name = eqn.primitive.name
    partial = [i for i, k in enumerate(kinds) if k.partial]
    if not partial:
        return None
    if name in LINEAR_IN:
        positions = LINEAR_IN[name](len(kinds))
        return positions if _partial_ok(p, eqn, kinds, single, positions) else None
    if name == "convert_element_type":
        src, dst = _aval(eqn.invars[0]).dtype, _aval(eqn.outvars[0]).dtype
        ok = jnp.issubdtype(src, jnp.inexact) and jnp.issubdtype(dst, jnp.inexact)
        return (0,) if ok and _partial_ok(p, eqn, kinds, single, (0,)) else None
    if name in ("mul", "div") and len(partial) == 1:
        i = partial[0]
        others = [j for j in range(len(kinds)) if j != i]
        if name == "div" and i != 0:
            return None
        if single[i] and all(kinds[j].is_replicated for j in others):
            return (i,)
        return None
    if name == "select_n":
        cases = tuple(range(1, len(kinds)))
        if kinds[0].is_replicated and _partial_ok(p, eqn, kinds, single, cases):
            return cases
    return None


def elementwise_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    out_shape = _shape(eqn.outvars[0])
    positions = _linear_positions(p, eqn, kinds, single)
    if positions is not None:
        return _plan(eqn, _partial_inputs(p, eqn, kinds, positions), [PARTIAL] * len(eqn.outvars))
    dims = [k.dim for k, x in zip(kinds, eqn.invars) if k.dim is not None]
    if not dims:
        return _plan(eqn, [REPLICATED] * len(kinds), [REPLICATED] * len(eqn.outvars))
    d = dims[0]
    wanted = []
    for x, k in zip(eqn.invars, kinds):
        shape = _shape(x)
        if len(shape) == len(out_shape) and shape[d] == out_shape[d]:
            wanted.append(sharded(d))  # a full-size operand: its block (a slice if replicated)
        else:
            wanted.append(REPLICATED)  # a scalar, or broadcast along d (size 1)
    outs = []
    for o in eqn.outvars:
        shape = _shape(o)
        outs.append(sharded(d) if len(shape) > d and shape[d] == out_shape[d] else REPLICATED)
    return _plan(eqn, wanted, outs)


# -- shape operations ---------------------------------------------------------------------
def broadcast_in_dim_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    k = kinds[0]
    shape = tuple(eqn.params["shape"])
    dims = tuple(eqn.params["broadcast_dimensions"])
    if len(kinds) == 1 and k.partial and single[0]:
        return _plan(eqn, [PARTIAL], [PARTIAL])  # a broadcast of a sum is the sum of broadcasts
    if len(kinds) == 1 and k.dim is not None and _shape(eqn.invars[0])[k.dim] == shape[dims[k.dim]]:
        e = dims[k.dim]
        local = local_shape(shape, sharded(e), p.ctx.axis_size)
        return _plan(eqn, [k], [sharded(e)], lambda v: bind_local(eqn, v, shape=local))
    return replicated_rule(p, eqn, kinds, single)


def reshaped_dim(in_shape: Sequence[int], out_shape: Sequence[int], d: int, axis_size: int) -> int | None:
    """The output dimension that holds dimension ``d``'s blocks after a row-major reshape, or
    None when the blocks do not stay whole (see the module doc of `.kinds`)."""
    prefix = 1
    for s in in_shape[:d]:
        prefix *= s
    acc = 1
    for e, s in enumerate(out_shape):
        if acc == prefix and s % axis_size == 0 and s > 1:
            return e
        acc *= s
        if acc > prefix:
            return None
    return None


def microbatch_rows(in_shape: Sequence[int], out_shape: Sequence[int], d: int, axis_size: int) -> int | None:
    """For a reshape that splits the sharded dimension ``d`` into ``(microbatches, rows)``,
    as gradient accumulation splits a batch, the output dimension of the rows, when it
    splits into ``axis_size`` blocks; None for any other reshape."""
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    if len(out_shape) != len(in_shape) + 1 or out_shape[:d] != in_shape[:d] or out_shape[d + 2 :] != in_shape[d + 1 :]:
        return None
    microbatches, rows = out_shape[d], out_shape[d + 1]
    if microbatches < 2 or microbatches * rows != in_shape[d] or rows % axis_size:
        return None
    return d + 1


def _as_microbatches(ctx: AxisContext, value: jax.Array, d: int, out_shape: Sequence[int]) -> jax.Array:
    """This device's rows of every microbatch, from its block of the batch: each microbatch
    holds the rows it holds in the plain step (row ``i * rows + j`` of the batch is row ``j``
    of microbatch ``i``), split over the devices as the batch was. The microbatches do not
    fall on device boundaries here (fewer of them than devices, or not a multiple), so the
    batch is gathered and sliced: a block of a batch of tokens is small beside the
    activations. (A multiple of the device count keeps whole microbatches on each device,
    `reshaped_dim`, and a scan over them swaps them for rows by one all-to-all.)"""
    whole = ctx.replicate(value, sharded(d)).reshape(tuple(out_shape))
    return ctx.block(whole, d + 1, out_shape)


def reshape_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    (k,) = kinds[:1]
    out_shape = _shape(eqn.outvars[0])
    if len(kinds) != 1 or eqn.params.get("dimensions") not in (None, ()):
        return replicated_rule(p, eqn, kinds, single)
    if k.partial:
        return _plan(eqn, [PARTIAL], [PARTIAL]) if single[0] else _plan(eqn, [REPLICATED], [REPLICATED])
    if k.dim is None:
        return _plan(eqn, [REPLICATED], [REPLICATED])
    e = reshaped_dim(_shape(eqn.invars[0]), out_shape, k.dim, p.ctx.axis_size)
    if (
        e is None
        and k.over is None
        and (rows := microbatch_rows(_shape(eqn.invars[0]), out_shape, k.dim, p.ctx.axis_size))
    ):
        return _plan(eqn, [k], [sharded(rows)], lambda v: [_as_microbatches(p.ctx, v[0], k.dim, out_shape)])
    if e is None:
        return replicated_rule(p, eqn, kinds, single, "reshapes across the sharded dimension")
    local = local_shape(out_shape, sharded(e), p.ctx.axis_size)
    if eqn.primitive.name == "reshape":
        return _plan(eqn, [k], [sharded(e)], lambda v: bind_local(eqn, v, new_sizes=local))
    return _plan(eqn, [k], [sharded(e)], lambda v: [lax.reshape(v[0], local)])


def moving_rule(new_dim: Callable[[JaxprEqn, int], int]) -> Rule:
    """A linear one-operand operation that moves dimensions around (transpose, squeeze): a
    block of dimension ``d`` becomes a block of ``new_dim(eqn, d)``; a partial sum stays one
    when this is its only use."""

    def rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
        (k,) = kinds
        if k.partial:
            kind = PARTIAL if single[0] else REPLICATED
            return _plan(eqn, [kind], [kind])
        if k.dim is None:
            return _plan(eqn, [REPLICATED], [REPLICATED])
        return _plan(eqn, [k], [sharded(new_dim(eqn, k.dim))])

    return rule


transpose_rule = moving_rule(lambda eqn, d: tuple(eqn.params["permutation"]).index(d))
squeeze_rule = moving_rule(lambda eqn, d: d - sum(1 for a in eqn.params["dimensions"] if a < d))


def _keep_along(
    p: Partitioner,
    eqn: JaxprEqn,
    kinds: list[Kind],
    single: list[bool],
    untouched: Callable[[int], bool],
    emit_for: Callable[[Kind], Callable] | None = None,
    linear: bool = False,
) -> EqnPlan:
    """A one-operand operation that works along some dimensions only: a block of a dimension
    it leaves alone (``untouched(d)``) stays a block of the same dimension."""
    k = kinds[0]
    rest = [REPLICATED] * (len(kinds) - 1)
    if k.partial:
        if linear and single[0] and all(r.is_replicated for r in kinds[1:]):
            return _plan(eqn, [PARTIAL] + rest, [PARTIAL] * len(eqn.outvars))
        return _plan(eqn, [REPLICATED] * len(kinds), [REPLICATED] * len(eqn.outvars))
    if k.dim is None:
        return replicated_rule(p, eqn, kinds, single)
    if not untouched(k.dim) or any(r.dim is not None for r in kinds[1:]):
        return replicated_rule(p, eqn, kinds, single, "works along the sharded (batch) dimension")
    emit = emit_for(k) if emit_for is not None else None
    return _plan(eqn, [k] + rest, [k] * len(eqn.outvars), emit)


def _shared_block(
    p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool], untouched: Callable[[int], bool], why: str
) -> EqnPlan:
    """Several operands of one rank that work together along some dimensions (a sort of
    several keys, pooling and its gradients): a block of a dimension they leave alone
    (``untouched(d)``) stays a block in every operand of that rank and in every result."""
    dims = {k.dim for k in kinds if k.dim is not None}
    if any(k.partial for k in kinds) or len(dims) > 1:
        return replicated_rule(p, eqn, kinds, single)
    if not dims:
        return _plan(eqn, [REPLICATED] * len(kinds), [REPLICATED] * len(eqn.outvars))
    d = dims.pop()
    if not untouched(d):
        return replicated_rule(p, eqn, kinds, single, why)
    rank = len(_shape(eqn.outvars[0]))
    wanted = [sharded(d) if len(_shape(x)) == rank else REPLICATED for x in eqn.invars]
    return _plan(eqn, wanted, [sharded(d)] * len(eqn.outvars))


def slice_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    shape = _shape(eqn.invars[0])
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params["strides"] or (1,) * len(shape)

    def untouched(d: int) -> bool:
        return start[d] == 0 and limit[d] == shape[d] and strides[d] == 1

    def emit_for(k: Kind):
        local = tuple(limit)[: k.split] + (shape[k.split] // p.ctx.axis_size,) + tuple(limit)[k.split + 1 :]
        return lambda v: bind_local(eqn, v, limit_indices=local)

    return _keep_along(p, eqn, kinds, single, untouched, emit_for, linear=True)


def pad_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    config = eqn.params["padding_config"]
    if kinds[0].partial and p.is_zero(eqn.invars[1]) and single[0]:
        return _plan(eqn, [PARTIAL, REPLICATED], [PARTIAL])
    return _keep_along(p, eqn, kinds, single, lambda d: tuple(config[d]) == (0, 0, 0))


def rev_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    dims = tuple(eqn.params["dimensions"])
    return _keep_along(p, eqn, kinds, single, lambda d: d not in dims, linear=True)


def along_axis_rule(param: str, linear: bool = False) -> Rule:
    """Operations along the axes named by ``param`` (cumsum, sort, split, top_k): a block of
    another dimension stays a block."""

    def rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
        axis = eqn.params[param]
        axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
        if len(kinds) > 1:  # sort of several same-shaped operands
            return _shared_block(
                p, eqn, kinds, single, lambda d: d not in axes, "works along the sharded (batch) dimension"
            )
        return _keep_along(p, eqn, kinds, single, lambda d: d not in axes, linear=linear)

    return rule


def top_k_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    axis = eqn.params.get("axis", len(_shape(eqn.invars[0])) - 1)
    return _keep_along(p, eqn, kinds, single, lambda d: d != axis % len(_shape(eqn.invars[0])))


def trailing_rule(trailing: Callable[[JaxprEqn], int]) -> Rule:
    """Operations on the last ``trailing(eqn)`` dimensions (linear algebra, FFT): leading
    dimensions are batch dimensions and keep their blocks."""

    def rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
        rank = len(_shape(eqn.invars[0]))
        dims = {k.dim for k in kinds if k.dim is not None}
        if len(dims) != 1 or any(k.partial for k in kinds):
            return replicated_rule(p, eqn, kinds, single)
        d = dims.pop()
        if d >= rank - trailing(eqn):
            return replicated_rule(p, eqn, kinds, single, "works along the sharded (batch) dimension")
        return _plan(
            eqn, [sharded(d) if len(_shape(x)) > d else REPLICATED for x in eqn.invars], [sharded(d)] * len(eqn.outvars)
        )

    return rule


def concatenate_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    axis = eqn.params["dimension"]
    if any(k.partial for k in kinds) and _partial_ok(p, eqn, kinds, single, range(len(kinds))):
        return _plan(eqn, _partial_inputs(p, eqn, kinds, range(len(kinds))), [PARTIAL])
    dims = {k.dim for k in kinds if k.dim is not None}
    if not dims:
        return replicated_rule(p, eqn, kinds, single)
    d = dims.pop()
    if dims or d == axis or any(k.partial for k in kinds):
        return replicated_rule(p, eqn, kinds, single, "concatenates along the sharded (batch) dimension")
    return _plan(eqn, [sharded(d)] * len(kinds), [sharded(d)])


def stack_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    """``jnp.stack`` (the transpose of unstacking): same-shaped operands stacked along a new
    ``axis``; their blocks of one dimension are a block of the result, the dimension shifted
    past the new axis."""
    axis = eqn.params["axis"]
    if any(k.partial for k in kinds) and _partial_ok(p, eqn, kinds, single, range(len(kinds))):
        return _plan(eqn, _partial_inputs(p, eqn, kinds, range(len(kinds))), [PARTIAL])
    dims = {k.dim for k in kinds if k.dim is not None}
    if not dims or len(dims) > 1 or any(k.partial or k.is_special for k in kinds):
        return replicated_rule(p, eqn, kinds, single)
    d = dims.pop()
    return _plan(eqn, [sharded(d)] * len(kinds), [sharded(d if d < axis else d + 1)])


def unstack_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    """``jnp.unstack`` along ``axis``: a block of another dimension is a block of every slice
    (the dimension shifted down past the removed axis); a partial sum stays one."""
    axis = eqn.params["axis"]
    k = kinds[0]
    if k.partial:
        kind = PARTIAL if single[0] else REPLICATED
        return _plan(eqn, [kind], [kind] * len(eqn.outvars))
    if k.dim is None or k.is_special:
        return replicated_rule(p, eqn, kinds, single)
    if k.dim == axis:
        return replicated_rule(p, eqn, kinds, single, "unstacks along the sharded (batch) dimension")
    out = sharded(k.dim if k.dim < axis else k.dim - 1)
    return _plan(eqn, [k], [out] * len(eqn.outvars))


def iota_like_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    return _plan(eqn, [REPLICATED] * len(kinds), [REPLICATED] * len(eqn.outvars))


def _split_by_constraint(
    p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], spec: PartitionSpec | None
) -> EqnPlan | None:
    """A whole value that the step places split over the data axes (its batch, passed
    replicated and split inside, as EasyLM does): from here on this device's block, a slice
    without traffic, exactly the rows XLA's partitioner gives it."""
    if spec is None or len(kinds) != 1 or not kinds[0].is_replicated:
        return None
    data = set(p.ctx.axes)
    for d, entry in enumerate(spec):
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None)
        axes = tuple(a for a in axes if a in data or a in p.ctx.model_axes)
        if not axes:
            continue
        if tuple(a for a in axes if a in data) != tuple(p.ctx.axes) or len(axes) != len(p.ctx.axes):
            return None
        shape = _shape(eqn.invars[0])
        if not p.ctx.can_shard(shape, d):
            return None
        return _plan(eqn, [REPLICATED], [sharded(d)], lambda values: [p.ctx.block(values[0], d, shape)])
    return None


def _spec_kind(p: Partitioner, spec: PartitionSpec, mesh: Mesh | AbstractMesh) -> Kind | None:
    """What one device holds of an inner ``shard_map``'s operand or result of ``spec``: the
    whole value (no data axis), its block of one dimension over exactly the data axes, or
    None for any other layout (a model axis, or some of the data axes)."""
    dims = []
    for d, entry in enumerate(spec):
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a is not None)
        axes = tuple(a for a in axes if mesh.shape[a] > 1)
        if axes:
            dims.append((d, axes))
    if not dims:
        return REPLICATED
    if len(dims) == 1 and dims[0][1] == tuple(p.ctx.axes):
        return sharded(dims[0][0])
    return None


def shard_map_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    """A ``jax.shard_map`` inside a ``jax.jit`` step, manual over the data axes (big_vision
    writes its mixup so): its body is per device already, so it runs as written on this
    device's blocks (each operand converted to the block its ``in_specs`` name)."""
    mesh = eqn.params["mesh"]
    manual = set(eqn.params.get("manual_axes", mesh.axis_names))
    manual = {a for a in manual if mesh.shape[a] > 1}
    ins = [_spec_kind(p, spec, mesh) for spec in eqn.params["in_specs"]]
    outs = [_spec_kind(p, spec, mesh) for spec in eqn.params["out_specs"]]
    in_kinds, out_kinds = [k for k in ins if k is not None], [k for k in outs if k is not None]
    if manual != set(p.ctx.axes) or len(in_kinds) != len(ins) or len(out_kinds) != len(outs):
        raise p.refuse(
            eqn,
            f"it is manual over {sorted(manual)} with in_specs {tuple(eqn.params['in_specs'])} and "
            f"out_specs {tuple(eqn.params['out_specs'])}; inside a jax.jit step jaxsched runs a "
            f"shard_map that is manual over exactly the data axes {tuple(p.ctx.axes)} and splits "
            "each operand over all of them or none. Write the whole per-device step as one "
            "jax.shard_map (the form jaxsched schedules as written), or the inner part as "
            "jax.numpy on global arrays",
        )
    body = eqn.params["jaxpr"]
    body = body.jaxpr if hasattr(body, "jaxpr") else body
    return _plan(eqn, in_kinds, out_kinds, lambda values: eval_inline(body, [], values))


def identity_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    """Placement annotations (``reshard``, sharding constraints): along the data axes they are
    no-ops per device. Along model axes (tensor parallelism, which stays XLA's to partition,
    ``Auto`` inside the body) both become a sharding constraint on those axes only, so that XLA
    lays out the layer as the user asked."""
    model = set(p.ctx.model_axes)
    sharding = eqn.params.get("dst_sharding" if eqn.primitive.name == "reshard" else "sharding")
    spec = getattr(sharding, "spec", None)
    if p.ctx.split_inside and (split := _split_by_constraint(p, eqn, kinds, spec)) is not None:
        return split
    if eqn.primitive.name not in ("sharding_constraint", "reshard") or not model or spec is None:
        return _plan(eqn, list(kinds), list(kinds), lambda values: list(values))
    entries = []
    for entry in spec:
        axes = (
            () if entry is None else tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a in model)
        )
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    if not any(e is not None for e in entries):
        return _plan(eqn, list(kinds), list(kinds), lambda values: list(values))
    from jax.sharding import PartitionSpec

    kept = PartitionSpec(*entries)
    return _plan(eqn, list(kinds), list(kinds), lambda values: [lax.with_sharding_constraint(v, kept) for v in values])


# -- reductions ----------------------------------------------------------------------------
def _reduce_rule(finish: Finish | None, linear: bool = False) -> Rule:
    """``reduce_*`` over ``axes``: over the sharded dimension a local reduction, then a partial
    sum (``linear``) or ``finish`` (a ``pmax``, ``pmin``); None: gather instead."""

    def rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
        (k,) = kinds
        axes = tuple(eqn.params["axes"])
        if k.partial:
            if linear and single[0]:
                return _plan(eqn, [PARTIAL], [PARTIAL])
            return _plan(eqn, [REPLICATED], [REPLICATED])
        if k.dim is None:
            return _plan(eqn, [REPLICATED], [REPLICATED])
        if k.dim not in axes:
            return _plan(eqn, [k], [sharded(k.dim - sum(1 for a in axes if a < k.dim))])
        if linear:
            return _plan(eqn, [k], [PARTIAL])
        if finish is None:
            return replicated_rule(p, eqn, kinds, single, "reduces over the sharded (batch) dimension")
        return _plan(eqn, [k], [REPLICATED], lambda v: [finish(p, bind_local(eqn, v)[0])])

    return rule


def _as_int_then(collective: Callable) -> Finish:
    def finish(p: Partitioner, value: jax.Array) -> jax.Array:
        if value.dtype == jnp.bool_:
            return collective(value.astype(jnp.int32), p.ctx.axis_name).astype(jnp.bool_)
        return collective(value, p.ctx.axis_name)

    return finish


def _argminmax_keep(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    (k,) = kinds
    axes = tuple(eqn.params["axes"])
    if k.dim is None or k.dim in axes:
        return (
            replicated_rule(p, eqn, kinds, single, "reduces over the sharded (batch) dimension")
            if k.dim is not None
            else _plan(eqn, [REPLICATED], [REPLICATED])
        )
    return _plan(eqn, [k], [sharded(k.dim - sum(1 for a in axes if a < k.dim))])


# -- contractions --------------------------------------------------------------------------
def dot_general_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
    lhs, rhs = kinds
    if lhs.partial or rhs.partial:
        i, other = (0, rhs) if lhs.partial else (1, lhs)
        if single[i] and other.is_replicated:
            return _plan(eqn, [PARTIAL, REPLICATED] if i == 0 else [REPLICATED, PARTIAL], [PARTIAL])
        lhs = REPLICATED if lhs.partial else lhs
        rhs = REPLICATED if rhs.partial else rhs
    l_rank, r_rank = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    l_free = [d for d in range(l_rank) if d not in lc and d not in lb]
    r_free = [d for d in range(r_rank) if d not in rc and d not in rb]
    nb = len(lb)

    if lhs.dim is not None and rhs.dim is not None:
        d, e = lhs.dim, rhs.dim
        if d in lc and e in rc and lc.index(d) == rc.index(e):
            return _plan(eqn, [lhs, rhs], [PARTIAL])
        if d in lb and e in rb and lb.index(d) == rb.index(e):
            return _plan(eqn, [lhs, rhs], [sharded(lb.index(d))])
        p.gathered(eqn, "contracts two batch-sharded operands along different dimensions")
        rhs = REPLICATED
    if lhs.dim is not None:
        d = lhs.dim
        if d in lc:
            return _plan(eqn, [lhs, sharded(rc[lc.index(d)])], [PARTIAL])
        if d in lb:
            return _plan(eqn, [lhs, sharded(rb[lb.index(d)])], [sharded(lb.index(d))])
        return _plan(eqn, [lhs, REPLICATED], [sharded(nb + l_free.index(d))])
    if rhs.dim is not None:
        e = rhs.dim
        if e in rc:
            return _plan(eqn, [sharded(lc[rc.index(e)]), rhs], [PARTIAL])
        if e in rb:
            return _plan(eqn, [sharded(lb[rb.index(e)]), rhs], [sharded(rb.index(e))])
        return _plan(eqn, [REPLICATED, rhs], [sharded(nb + len(l_free) + r_free.index(e))])
    return _plan(eqn, [REPLICATED, REPLICATED], [REPLICATED])


def conv_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    lhs, rhs = kinds
    dn = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    groups = eqn.params.get("feature_group_count", 1)
    batch_groups = eqn.params.get("batch_group_count", 1)
    if lhs.partial and single[0] and rhs.is_replicated:
        return _plan(eqn, [PARTIAL, REPLICATED], [PARTIAL])
    if rhs.partial and single[1] and lhs.is_replicated:
        return _plan(eqn, [REPLICATED, PARTIAL], [PARTIAL])
    if lhs.partial or rhs.partial:
        return replicated_rule(p, eqn, kinds, single)
    if lhs.dim == lhs_spec[0] and rhs.is_replicated and batch_groups == 1:
        return _plan(eqn, [lhs, REPLICATED], [sharded(out_spec[0])])
    if lhs.dim == lhs_spec[1] and rhs.dim == rhs_spec[1] and groups == 1:
        return _plan(eqn, [lhs, rhs], [PARTIAL])  # a kernel gradient: contracts the batch
    if lhs.dim is None and rhs.dim is None:
        return _plan(eqn, [REPLICATED, REPLICATED], [REPLICATED])
    return replicated_rule(p, eqn, kinds, single, "convolves across the sharded (batch) dimension")


# -- indexing ------------------------------------------------------------------------------
def _batch_positions(out_rank: int, offset_dims: Sequence[int]) -> list[int]:
    return [d for d in range(out_rank) if d not in offset_dims]


def gather_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    operand, indices = kinds
    dn = eqn.params["dimension_numbers"]
    op_shape = _shape(eqn.invars[0])
    idx_rank = len(_shape(eqn.invars[1]))
    out_rank = len(_shape(eqn.outvars[0]))
    batch_out = _batch_positions(out_rank, dn.offset_dims)
    if operand.partial and indices.is_replicated and single[0]:
        return _plan(eqn, [PARTIAL, REPLICATED], [PARTIAL])
    if operand.partial or indices.partial:
        return replicated_rule(p, eqn, kinds, single)
    if (
        operand.dim is None
        and indices.dim is not None
        and indices.dim < idx_rank - 1
        and indices.dim not in dn.start_indices_batching_dims  # else the operand's rows are cut too (below)
    ):
        return _plan(eqn, [REPLICATED, indices], [sharded(batch_out[indices.dim])])
    if operand.dim is not None and operand.dim in dn.operand_batching_dims:
        i = dn.start_indices_batching_dims[dn.operand_batching_dims.index(operand.dim)]
        if indices.dim in (None, i):
            return _plan(eqn, [operand, sharded(i)], [sharded(batch_out[i])])
    if operand.dim is None and indices.dim is not None:
        i = indices.dim
        if i in dn.start_indices_batching_dims:
            d = dn.operand_batching_dims[dn.start_indices_batching_dims.index(i)]
            return _plan(eqn, [sharded(d), indices], [sharded(batch_out[i])])
    if operand.dim is not None and indices.dim is None:
        d = operand.dim
        window = [
            a for a in range(len(op_shape)) if a not in dn.collapsed_slice_dims and a not in dn.operand_batching_dims
        ]
        sizes = tuple(eqn.params["slice_sizes"])
        if d in window and d not in dn.start_index_map and sizes[d] == op_shape[d]:
            local = sizes[:d] + (op_shape[d] // p.ctx.axis_size,) + sizes[d + 1 :]
            return _plan(
                eqn,
                [operand, REPLICATED],
                [sharded(dn.offset_dims[window.index(d)])],
                lambda v: bind_local(eqn, v, slice_sizes=local),
            )
    if operand.dim is None and indices.dim is None:
        return _plan(eqn, [REPLICATED, REPLICATED], [REPLICATED])
    return replicated_rule(p, eqn, kinds, single, "gathers rows across the sharded (batch) dimension")


def scatter_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    operand, indices, updates = kinds[:3]
    dn = eqn.params["dimension_numbers"]
    op_shape = _shape(eqn.invars[0])
    upd_rank = len(_shape(eqn.invars[2]))
    idx_rank = len(_shape(eqn.invars[1]))
    is_add = eqn.primitive.name == "scatter-add" or eqn.primitive.name == "scatter_add"
    extra = [REPLICATED] * (len(kinds) - 3)
    upd_scatter = [d for d in range(upd_rank) if d not in dn.update_window_dims]
    if (
        is_add
        and indices.is_replicated
        and (updates.partial or p.is_zero(eqn.invars[2]))
        and _partial_ok(p, eqn, kinds, single, (0, 2))
    ):
        return _plan(eqn, _partial_inputs(p, eqn, kinds, (0, 2))[:3] + extra, [PARTIAL])
    if any(k.partial for k in kinds):
        return replicated_rule(p, eqn, kinds, single)
    # rows of the operand scattered into by the same device's rows (take_along_axis)
    batch_pairs = list(zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims))
    for d, i in batch_pairs:
        if (
            operand.dim in (None, d)
            and indices.dim in (None, i)
            and (operand.dim == d or indices.dim == i or updates.dim is not None)
            and i < idx_rank - 1
            and op_shape[d] % p.ctx.axis_size == 0
        ):
            u = upd_scatter[i]
            if updates.dim in (None, u):
                return _plan(eqn, [sharded(d), sharded(i), sharded(u)] + extra, [sharded(d)])
    # a whole window dimension of the operand, filled by the same dimension of the updates
    window = [a for a in range(len(op_shape)) if a not in dn.inserted_window_dims and a not in dn.operand_batching_dims]
    if indices.is_replicated and (operand.dim is not None or updates.dim is not None):
        d = operand.dim if operand.dim is not None else None
        if d is None and updates.dim in dn.update_window_dims:
            d = window[list(dn.update_window_dims).index(updates.dim)]
        if d is not None and d in window and d not in dn.scatter_dims_to_operand_dims:
            u = dn.update_window_dims[window.index(d)]
            if _shape(eqn.invars[2])[u] == op_shape[d] and updates.dim in (None, u):
                return _plan(eqn, [sharded(d), REPLICATED, sharded(u)] + extra, [sharded(d)])
    # per-example rows added into a replicated table (an embedding's gradient)
    if (
        is_add
        and operand.dim is None
        and indices.dim is not None
        and indices.dim < idx_rank - 1
        and updates.dim in (None, upd_scatter[indices.dim])
        and not batch_pairs
    ):
        return _plan(eqn, [PARTIAL, indices, sharded(upd_scatter[indices.dim])] + extra, [PARTIAL])
    if all(k.is_replicated for k in kinds):
        return _plan(eqn, [REPLICATED] * len(kinds), [REPLICATED])
    return replicated_rule(p, eqn, kinds, single, "scatters across the sharded (batch) dimension")


def dynamic_slice_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    shape = _shape(eqn.invars[0])
    sizes = tuple(eqn.params["slice_sizes"])

    def emit_for(k: Kind):
        local = sizes[: k.split] + (shape[k.split] // p.ctx.axis_size,) + sizes[k.split + 1 :]
        return lambda v: bind_local(eqn, v, slice_sizes=local)

    return _keep_along(p, eqn, kinds, single, lambda d: sizes[d] == shape[d], emit_for, linear=True)


def dynamic_update_slice_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    operand, update = kinds[:2]
    rest = [REPLICATED] * (len(kinds) - 2)
    op_shape, up_shape = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    if (
        (operand.partial or update.partial)
        and _partial_ok(p, eqn, kinds, single, (0, 1))
        and all(k.is_replicated for k in kinds[2:])
    ):
        return _plan(eqn, _partial_inputs(p, eqn, kinds, (0, 1))[:2] + rest, [PARTIAL])
    dims = {k.dim for k in (operand, update) if k.dim is not None}
    if len(dims) == 1 and not (operand.partial or update.partial):
        d = dims.pop()
        if op_shape[d] == up_shape[d]:
            return _plan(eqn, [sharded(d), sharded(d)] + rest, [sharded(d)])
    if not dims and not (operand.partial or update.partial):
        return _plan(eqn, [REPLICATED] * len(kinds), [REPLICATED])
    return replicated_rule(p, eqn, kinds, single, "updates a slice across the sharded (batch) dimension")


def window_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    """Pooling and its gradients: a window of one element along the batch keeps its blocks."""
    params = eqn.params
    n = len(_shape(eqn.invars[0]))
    window = params.get("window_dimensions", (1,) * n)
    strides = params.get("window_strides", (1,) * n)
    padding = params.get("padding", ((0, 0),) * n)
    base = params.get("base_dilation", (1,) * n) or (1,) * n
    win_dil = params.get("window_dilation", (1,) * n) or (1,) * n

    def untouched(d: int) -> bool:
        return window[d] == 1 and strides[d] == 1 and tuple(padding[d]) == (0, 0) and base[d] == 1 and win_dil[d] == 1

    return _shared_block(p, eqn, kinds, single, untouched, "pools across the sharded (batch) dimension")


def bitcast_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    (k,) = kinds
    rank = min(len(_shape(eqn.invars[0])), len(_shape(eqn.outvars[0])))
    if k.dim is not None and k.dim < rank:
        return _plan(eqn, [k], [k])
    return replicated_rule(p, eqn, kinds, single)


def random_bits_rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
    """Random bits of a batch of keys keep the keys' blocks; of one key, the draw is whole
    (every device draws the same bits the global program draws)."""
    (k,) = kinds
    if k.dim is None:
        return _plan(eqn, [REPLICATED], [REPLICATED])
    key_rank = len(_shape(eqn.invars[0]))
    shape = tuple(eqn.params["shape"])
    local = shape[: k.dim] + (shape[k.dim] // p.ctx.axis_size,) + shape[k.dim + 1 :]
    if k.dim < key_rank:
        return _plan(eqn, [k], [k], lambda v: bind_local(eqn, v, shape=local))
    return replicated_rule(p, eqn, kinds, single)


def refuse_rule(why: str) -> Rule:
    def rule(p: Partitioner, eqn: JaxprEqn, kinds: list[Kind], single: list[bool]) -> EqnPlan:
        if _all_replicated(kinds) and eqn.primitive.name != "shard_map":
            return _plan(eqn, list(kinds), [REPLICATED] * len(eqn.outvars))
        raise p.refuse(eqn, why)

    return rule


# -- the table, by family ------------------------------------------------------------------
def defelementwise(table: RuleDict, names: Iterable[str]) -> None:
    """Plan each of ``names`` by `elementwise_rule`."""
    table.update(dict.fromkeys(names, elementwise_rule))


def defreducer(table: RuleDict, name: str, finish: Finish | None, linear: bool = False) -> None:
    """Plan array reduction ``name`` over the sharded dimension as a local one then a partial
    sum (``linear``), or ``finish`` (a collective), or (neither) a gather first."""
    table[name] = _reduce_rule(finish, linear)


def defalong(table: RuleDict, names: Iterable[str], param: str, linear: bool = False) -> None:
    """Plan each of ``names`` as an operation along the axes its ``param`` names."""
    rule = along_axis_rule(param, linear)
    table.update(dict.fromkeys(names, rule))


def defshared(table: RuleDict, names: Iterable[str], rule: Rule) -> None:
    """Plan each of ``names`` by ``rule`` (a family that shares one rule: scatters, windows)."""
    table.update(dict.fromkeys(names, rule))


def deftrailing(table: RuleDict, names: Iterable[str], trailing: Callable[[JaxprEqn], int]) -> None:
    """Plan each of ``names`` as an operation on its last ``trailing(eqn)`` dimensions."""
    rule = trailing_rule(trailing)
    table.update(dict.fromkeys(names, rule))


#: Array reductions over the sharded dimension, by how the local results are combined
#: (None: they are not, the operand is gathered first); ``reduce_sum`` stays a partial sum.
REDUCER_FINISH: dict[str, Finish | None] = {
    "reduce_sum": None,
    "reduce_max": lambda p, v: lax.pmax(v, p.ctx.axis_name),
    "reduce_min": lambda p, v: lax.pmin(v, p.ctx.axis_name),
    "reduce_and": _as_int_then(lax.pmin),
    "reduce_or": _as_int_then(lax.pmax),
    "reduce_prod": None,
    "reduce_xor": None,
}
#: The scatters: `scatter_rule` tells an add (a sum of rows) from the others by name.
SCATTERS = frozenset(
    {
        "scatter-add",
        "scatter_add",
        "scatter",
        "scatter-mul",
        "scatter_mul",
        "scatter-min",
        "scatter_min",
        "scatter-max",
        "scatter_max",
    }
)
#: Pooling and its gradients.
WINDOWS = frozenset(
    {
        "reduce_window_sum",
        "reduce_window_max",
        "reduce_window_min",
        "reduce_window",
        "select_and_scatter_add",
        "select_and_gather_add",
    }
)
#: Linear algebra on the last two dimensions.
MATRIX_OPS = frozenset({"cholesky", "triangular_solve", "lu", "qr", "eigh", "svd"})


def _build() -> RuleDict:
    table: RuleDict = {}
    defelementwise(table, ELEMENTWISE)
    for name in primitives.ARRAY_REDUCTIONS:
        defreducer(table, name, REDUCER_FINISH[name], linear=name == "reduce_sum")
    defshared(table, SCATTERS, scatter_rule)
    defshared(table, WINDOWS, window_rule)
    defshared(table, primitives.PLACEMENT | primitives.VMA_TYPING, identity_rule)
    defalong(table, ("cumsum", "split"), "axis", linear=True)
    defalong(table, ("cumprod", "cummax", "cummin", "cumlogsumexp"), "axis")
    defalong(table, ("sort",), "dimension")
    defalong(table, ("approx_top_k",), "reduction_dimension")
    deftrailing(table, MATRIX_OPS, lambda e: 2)
    deftrailing(table, ("fft",), lambda e: len(e.params["fft_lengths"]))
    table.update(
        {
            "random_bits": random_bits_rule,
            "broadcast_in_dim": broadcast_in_dim_rule,
            "reshape": reshape_rule,
            "expand_dims": reshape_rule,
            "transpose": transpose_rule,
            "squeeze": squeeze_rule,
            "slice": slice_rule,
            "pad": pad_rule,
            "rev": rev_rule,
            "concatenate": concatenate_rule,
            "stack": stack_rule,
            "unstack": unstack_rule,
            "iota": iota_like_rule,
            "bitcast_convert_type": bitcast_rule,
            "argmax": _argminmax_keep,
            "argmin": _argminmax_keep,
            "dot_general": dot_general_rule,
            "conv_general_dilated": conv_rule,
            "gather": gather_rule,
            "dynamic_slice": dynamic_slice_rule,
            "dynamic_update_slice": dynamic_update_slice_rule,
            "top_k": top_k_rule,
            "shard_map": shard_map_rule,
        }
    )
    return table


#: The forward rule of each primitive (calls and control flow aside: `rule_for`).
RULES: RuleDict = _build()


def rule_for(eqn: JaxprEqn) -> Rule:
    """The rule of ``eqn``'s primitive; calls and control flow come from
    `jaxsched.core.partition._control_flow`; the exact fallback for anything else."""
    name = eqn.primitive.name
    if name in RULES:
        return RULES[name]
    if name in CONTROL_RULES:
        return CONTROL_RULES[name]
    if is_call(eqn):
        return call_rule
    return replicated_rule
