"""Partition: a ``jax.jit`` data-parallel step as the per-device step the pipeline schedules.

Most data-parallel JAX code never writes a per-device body: parameters are replicated,
the batch is placed with ``NamedSharding(mesh, P("data"))``, and XLA's partitioner adds
the gradient sums. This stage does what that partitioner does, in a form the rest of
jaxsched can read: it interprets the step's global jaxpr per device
(`.interpreter`, with one rule per primitive in `.rules` and
`.control_flow`), tracking which dimension of each value is sharded over the data
axes (`.kinds`), and traces the result as a ``shard_map`` body. A sum, mean or
contraction over the batch becomes a local one plus one ``psum`` where its value is
complete; those ``psum``s of gradients are the reductions every strategy schedules, and
the others (a loss averaged over the global batch, a global token count, batch-norm
statistics) stay where they are.

Parameters may be sharded too (`.placement`). A parameter sharded over data axes is a
block (`.blocks`): gathered where forward or backward reads it whole, its gradient
reduce-scattered into the block (then summed over the other data axes, HSDP's replica
axis): FSDP as XLA runs it, with its reductions made explicit for the strategies. Model
axes (tensor parallelism) are left to XLA: the body is manual over the data axes only
(`manual_shard_map`).

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("data",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    >>> x = jax.device_put(np.ones((4, 3), np.float32), NamedSharding(mesh, P("data")))
    >>> step = jax.jit(lambda w, x: (w - 0.1 * jax.grad(lambda w: jnp.mean(x @ w))(w),))
    >>> closed = jax.make_jaxpr(step)(np.ones((3,), np.float32), x)
    >>> part = partition(closed, [np.ones(3, np.float32), x], ["params/w", "batch"],
    ...                  ["params", "batch"], num_state_outputs=1)
    >>> [e.primitive.name for e in part.body.eqns if e.primitive.name == "psum"]
    ['psum']
"""

from __future__ import annotations

from jaxsched import _deprecations

import dataclasses
from typing import Any, Sequence

import jax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsched.core import _replay as replay
from jaxsched.core.partition._interpreter import GatherWarning, Partitioner, PartitionError
from jaxsched.core.partition._table import TABLE
from jaxsched.core.partition._kinds import AxisContext, Kind, REPLICATED
from jaxsched.core.partition._placement import (
    Placement,
    PlacementError,
    _top_out_shardings,
    manual_spec,
    read_placement,
    unplaced_inputs,
)

__all__ = ["GatherWarning", "PartitionError", "Partitioned", "PlacementError", "manual_shard_map", "partition"]


@dataclasses.dataclass(frozen=True)
class Partitioned:
    """A global step as a per-device one.

    Attributes:
      body: the per-device jaxpr: inputs are the step's flat input leaves then the global
        jaxpr's constants; outputs the step's flat outputs.
      placement: the mesh, data axes and input specs.
      const_values: the global jaxpr's constants (replicated inputs of ``body``).
      in_specs, out_specs: the specs of ``body``'s inputs and outputs over the whole mesh (a
        ``shard_map`` manual over ``placement.manual_axes`` takes them restricted to those).
      gathers: ``(primitive, source line)`` of operations that gather the batch.
    """

    body: Any
    placement: Placement
    const_values: tuple
    in_specs: tuple[P, ...]
    out_specs: tuple[P, ...]
    gathers: tuple[tuple[str, str], ...]


def _spec(kind: Kind, axis_name: Any, rank: int) -> P:
    if kind.dim is None:
        return P()
    axes = axis_name if kind.over is None else (kind.over[0] if len(kind.over) == 1 else kind.over)
    return P(*([None] * kind.dim + [axes] + [None] * (rank - kind.dim - 1)))


def _aux_kind(natural: Kind, out: Any, hints: dict) -> Kind:
    """How an aux output leaves the step: as computed (replicated, or a block), and a partial
    sum reduced, into the parameter block that the same value meets in the update (a
    gradient returned beside the new parameters: one reduce-scatter serves both, and the
    output is laid out as the plain step lays it out), or else whole."""
    if not natural.partial:
        return natural
    hint = hints.get(out) if isinstance(out, jex_core.Var) else None
    return hint if hint is not None and hint.is_block else REPLICATED


def partition(
    closed, leaves: Sequence[Any], names: Sequence[str], roles: Sequence[str], num_state_outputs: int
) -> Partitioned:
    """The per-device form of the global step traced as ``closed`` on flat ``leaves``.

    The first ``num_state_outputs`` outputs (the new parameters and optimizer state, in the
    order of the first inputs) come out as their inputs came in: replicated, or the blocks
    of a sharded parameter; the others (aux) as the step computes them: replicated, blocks
    of the batch, or blocks of a parameter (`_aux_kind`)."""
    placement = read_placement(closed, leaves, names, roles, num_state_outputs)
    returned = [s is not None for s in _top_out_shardings(closed, num_state_outputs)]
    closed = _inlined(closed, placement)
    placement = _placed_as_returned(closed, placement, leaves, names, roles, returned)
    model = (
        ()
        if placement.manual_axes is None
        else tuple(a for a in placement.mesh.axis_names if a not in placement.manual_axes)
    )
    ctx = AxisContext(
        placement.axis_name, placement.axis_size, placement.axis_sizes, model, placement.split_inside, placement.mesh
    )
    partitioner = Partitioner(ctx, TABLE)
    jaxpr = closed.jaxpr
    natural = partitioner.plan(jaxpr, placement.kinds).out_kinds
    state_kinds = tuple(placement.kinds[:num_state_outputs])
    hints = TABLE.hints_for(jaxpr, state_kinds + natural[num_state_outputs:])
    out_kinds = state_kinds + tuple(
        _aux_kind(k, v, hints) for k, v in zip(natural[num_state_outputs:], jaxpr.outvars[num_state_outputs:])
    )
    plan = partitioner.plan(jaxpr, placement.kinds, out_kinds)
    n_in = len(jaxpr.invars)

    def per_device(*args):
        return tuple(partitioner.run(plan, args[n_in:], args[:n_in]))

    consts = tuple(closed.consts)
    in_specs = placement.specs + (P(),) * len(consts)
    out_specs = tuple(
        placement.specs[i] if i < num_state_outputs else _spec(k, placement.axis_name, len(v.aval.shape))
        for i, (k, v) in enumerate(zip(out_kinds, jaxpr.outvars))
    )
    mesh, manual = placement.mesh, placement.manual_axes
    args = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=NamedSharding(mesh, spec))
        for v, spec in zip(jaxpr.invars, placement.specs)
    ]
    args += [
        jax.ShapeDtypeStruct(jax.numpy.shape(c), jax.numpy.result_type(c), sharding=NamedSharding(mesh, P()))
        for c in consts
    ]
    mapped = manual_shard_map(per_device, mesh, in_specs, out_specs, manual)
    body, hoisted = _body_of(jax.make_jaxpr(mapped)(*args), len(args))
    consts += tuple(hoisted)
    in_specs += (P(),) * len(hoisted)
    return Partitioned(body, placement, consts, in_specs, out_specs, tuple(partitioner.gathers))


def _placed_as_returned(
    closed,
    placement: Placement,
    leaves: Sequence[Any],
    names: Sequence[str],
    roles: Sequence[str],
    returned: Sequence[bool],
) -> Placement:
    """``placement`` with each unplaced optimizer-state leaf (`unplaced_inputs`: host or
    single-device arrays, as ``jax.jit(tx.init)(params)`` leaves the moments) placed as its
    parameter is, as ``tx.init`` on the placed parameters places it: the plain step returns
    such a moment sharded like its parameter (XLA's propagation), and a scheduled state kept
    whole would hold it on every device. Its parameter is the one whose path ends the leaf's
    (``opt_state[0].mu['w1']`` is ``params['w1']``'s) and has its shape. So is a replicated
    leaf whose parameter the step returns in a layout it says (``out_shardings``, a
    ``with_sharding_constraint``: ``returned``, per state leaf) while saying nothing of the
    leaf's: XLA propagates the parameter's layout to it. Meshes with model axes keep the leaves as they came."""
    num_state = len(returned)
    # and a replicated leaf whose parameter the step returns in another layout than it
    # takes (out_shardings or a sharding constraint), when nothing says how the leaf returns
    followed = {
        i
        for i in range(num_state)
        if roles[i] == "opt_state" and not returned[i] and not placement.kinds[i].is_block and any(returned)
    }
    unplaced = [
        i for i in sorted(unplaced_inputs(closed, leaves) | followed) if i < num_state and roles[i] == "opt_state"
    ]
    if not unplaced or placement.manual_axes is not None or placement.axis_size == 1:
        return placement
    params = [
        (names[j][len("params") :], j)
        for j in range(num_state)
        if roles[j] == "params" and placement.kinds[j].is_block and names[j].startswith("params")
    ]
    if not params:
        return placement
    jaxpr = closed.jaxpr
    kinds, specs = list(placement.kinds), list(placement.specs)
    for i in unplaced:
        shape = jaxpr.invars[i].aval.shape
        owners = [(len(path), j) for path, j in params if path and names[i].endswith(path)]
        owners = [
            (n, j) for n, j in owners if jaxpr.invars[j].aval.shape == shape and (i not in followed or returned[j])
        ]
        if owners:
            j = max(owners)[1]
            kinds[i], specs[i] = placement.kinds[j], placement.specs[j]
    return dataclasses.replace(placement, kinds=tuple(kinds), specs=tuple(specs))


def manual_shard_map(fn, mesh, in_specs: Sequence[P], out_specs: Sequence[P], manual: Any, check_vma: bool = False):
    """``jax.shard_map`` of ``fn`` manual over ``manual`` (None: every mesh axis), its specs
    given over the whole mesh and restricted here to the manual axes.

    The axes left to XLA are ``Auto`` inside, whatever the mesh's axis types: an ``Explicit``
    mesh's placement annotations become sharding constraints on them (the rules of
    `.rules`), so that the body needs no sharding in its types."""
    options = {} if manual is None else {"axis_names": frozenset(manual)}
    explicit = manual is not None and any(t != jax.sharding.AxisType.Auto for t in mesh.axis_types)
    if explicit:
        mesh = jax.sharding.Mesh(
            mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
        )
    mapped = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=tuple(manual_spec(s, manual) for s in in_specs),
        out_specs=tuple(manual_spec(s, manual) for s in out_specs),
        check_vma=check_vma,
        **options,
    )
    if not explicit:
        return mapped

    def on_auto_mesh(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the user's may be set
            return mapped(*args)

    return on_auto_mesh


def _inlined(closed, placement: Placement):
    """``closed`` with its ``jit`` and custom-derivative calls inlined (re-traced as one
    jaxpr), so that planning sees across them: a dropout mask drawn inside
    ``jax.random.bernoulli``'s own ``jit`` is read by the layer outside it, and only then can
    the draw be planned as this device's block."""
    mesh = placement.mesh
    args = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=NamedSharding(mesh, spec))
        for v, spec in zip(closed.jaxpr.invars, placement.specs)
    ]
    inlined = jax.make_jaxpr(lambda *a: replay.eval_inline(closed.jaxpr, closed.consts, a))(*args)
    return inlined.replace(jaxpr=_without_dead_code(inlined.jaxpr))


def _without_dead_code(jaxpr):
    """``jaxpr`` without dead equations (`jaxsched.core._replay.live_equations`): planning
    would take their demands for real, and a dead equation that reads a whole value keeps its
    producer from computing just a block."""
    live = replay.live_equations(jaxpr)
    return jaxpr.replace(eqns=[e for i, e in enumerate(jaxpr.eqns) if i in live])


def _body_of(traced, num_args: int) -> tuple[Any, list]:
    """The ``shard_map`` body of ``traced`` with its inputs in argument order, then the
    constants tracing hoisted out of it (arrays the rules or nested jaxprs closed over),
    with their values."""
    (eqn,) = [e for e in traced.jaxpr.eqns if e.primitive.name == "shard_map"]
    body = eqn.params["jaxpr"]
    body = body.jaxpr if hasattr(body, "jaxpr") else body
    origin = {v: i for i, v in enumerate(traced.jaxpr.invars)}
    const_of = dict(zip(traced.jaxpr.constvars, traced.consts))
    by_arg: dict[int, Any] = {}
    hoisted_vars, hoisted = [], []
    for inner, outer in zip(body.invars, eqn.invars, strict=True):
        if isinstance(outer, jex_core.Literal):
            hoisted_vars.append(inner)
            hoisted.append(outer.val)
        elif outer in origin and origin[outer] not in by_arg:
            by_arg[origin[outer]] = inner
        else:
            hoisted_vars.append(inner)
            hoisted.append(const_of[outer])
    if sorted(by_arg) != list(range(num_args)):
        raise AssertionError(f"the traced per-device body reads {len(by_arg)} of its {num_args} inputs")
    invars = [by_arg[i] for i in range(num_args)] + hoisted_vars
    return body.replace(invars=invars), hoisted


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
