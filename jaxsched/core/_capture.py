"""Capture: trace the user's step and find its data-parallel body.

A step is ``(params, opt_state, batch) -> (params, opt_state, aux)`` whose work happens
inside one ``shard_map`` (a jitted ``jax.shard_map`` or a ``jax.pmap``, which JAX 0.10
traces to the same thing), or a ``jax.jit`` step (or plain function) on global arrays whose
batch is sharded over mesh axes: `jaxsched.core.partition` turns that one into the
per-device body. Capture records the body jaxpr, the mesh, the specs, and which body input
is which leaf of params / opt_state / batch. Nothing here rewrites.

Example:
    >>> import jax, optax
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> from jaxsched.core._capture import capture
    >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> tx = optax.sgd(0.1)
    >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
    >>> captured = capture(steps.make_step(apply_fn, tx, mesh), params, tx.init(params), batch)
    >>> captured.kind, captured.axis_name, captured.num_params
    ('shard_map', 'data', 4)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax.extend import core as jex_core
from jax.extend.core import JaxprEqn
from jax.tree_util import PyTreeDef
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched._errors import JaxschedError
from jaxsched.core import _replay as replay
from jaxsched.core._axes import as_axes, axis_size, spec_axes
from jaxsched.core._describe import describe_outputs, difference
from jaxsched.core._primitives import CALL_PRIMITIVES, REDUCTIONS, VMA_TYPING, reduction_axes

__all__ = [
    "abstract_leaf",
    "capture",
    "CapturedStep",
    "data_axes",
    "donates_every_state_leaf",
    "flatten_calls",
    "Source",
    "UnsupportedStepError",
]


class UnsupportedStepError(JaxschedError, ValueError):
    """The step is not a data-parallel step jaxsched can schedule; the message says why.

    Raised on the first call of a scheduled step, when it is captured. It derives from
    ``ValueError`` too, so code that catches that keeps working.

    Example:
        >>> import jax, optax, jaxsched
        >>> from jaxsched.demo import steps
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> tx = optax.sgd(0.1)
        >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
        >>> step = steps.make_step(apply_fn, tx, mesh)
        >>> sched = jaxsched.schedule(lambda p, o, b: step(p, o, b)[0])  # drops the optimizer state
        >>> try:
        ...     sched(sched.init(params, tx.init(params)), batch)
        ... except jaxsched.UnsupportedStepError as err:
        ...     print(str(err).split(";")[0])
        the step returned 1 output (dict of 4 leaves)
    """


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a body input comes from: ``role`` is params, opt_state, batch or const."""

    role: str
    index: int  # leaf index within its tree (or position among consts)


@dataclasses.dataclass(frozen=True)
class CapturedStep:
    """The user's step, opened up.

    Attributes:
      kind: ``"shard_map"`` or ``"pmap"`` (how the user wrote it).
      body: the per-device jaxpr with nested calls inlined; its invars line up with
        ``sources``.
      user_body: the per-device jaxpr exactly as the user's step traced it (the identity
        strategy replays it, so it stays bit-identical).
      sources: for every body invar, which input leaf feeds it.
      consts: values for body invars whose source role is ``const``.
      outputs: for every flat output of the step, the body outvar index that produces it.
      mesh, axis_name, axis_size: where the data-parallel axis lives: ``axis_name`` is one
        mesh axis or a tuple of them (data parallel over several, e.g. slices and chips;
        `data_axes`), ``axis_size`` the number of devices along it.
      in_specs, out_specs: the shard_map specs of the body inputs and outputs.
      params_tree, opt_tree, batch_tree, aux_tree: tree structures of the step's pytrees.
      num_params, num_opt, num_batch: leaf counts of those trees.
      check_vma: whether the user's shard_map checked varying-manual-axes types.
      example_inputs: ``(params, opt_state, batch)`` as ``jax.ShapeDtypeStruct`` trees (with
        the shardings of placed arrays): enough to lower and compile the step again, e.g.
        to choose a strategy by XLA's estimate (`jaxsched.pipeline._compiled_planner`).
      global_step: for a ``jax.jit`` step (``kind == "jit"``), its global jaxpr as traced,
        which the identity strategy runs unchanged; None otherwise.
      gathers: for a ``jax.jit`` step, ``(primitive, source line)`` of every operation that
        mixes examples across the batch and so runs on the gathered batch
        (`jaxsched.core.partition.GatherWarning`).
      state_outputs: the shape and dtype of every new params and opt_state leaf the plain
        step returns (``jax.ShapeDtypeStruct``, flat, params first): what ``finalize`` must
        give back.
      manual_axes: the mesh axes the body is manual over: None for every axis; the data axes
        of a ``jax.jit`` step whose mesh has model axes, which XLA partitions inside the body
        (``in_specs``/``out_specs`` then name both; a ``shard_map`` takes them restricted,
        `jaxsched.core.partition.manual_shard_map`).
      donates_state: the step as jitted (or pmapped) donates every params and opt_state leaf
        (``donate_argnums``), so its caller never reads a state it passed in again: the
        scheduled program may donate its whole state too and update it in place
        (`donates_every_state_leaf`).
    """

    kind: str
    body: Any
    user_body: Any
    sources: tuple[Source, ...]
    consts: tuple[Any, ...]
    outputs: tuple[int, ...]
    mesh: Mesh
    axis_name: str | tuple[str, ...]
    axis_size: int
    in_specs: tuple[P, ...]
    out_specs: tuple[P, ...]
    params_tree: Any
    opt_tree: Any
    batch_tree: Any
    aux_tree: Any
    num_params: int
    num_opt: int
    num_batch: int
    check_vma: bool
    example_inputs: Any = None
    global_step: Any = None
    gathers: tuple = ()
    state_outputs: tuple = ()
    manual_axes: tuple[str, ...] | None = None
    donates_state: bool = False

    def body_input(self, role: str, index: int) -> int:
        """Position of the body invar fed by leaf ``index`` of ``role``, or -1."""
        return self._positions.get((role, index), -1)

    @functools.cached_property
    def _positions(self) -> dict:
        positions: dict = {}
        for i, src in enumerate(self.sources):
            positions.setdefault((src.role, src.index), i)
        return positions


def _structure(tree: Any) -> PyTreeDef:
    """``tree``'s structure, typed (``jax.tree.structure``'s stub names no attribute)."""
    return jax.tree.structure(tree)


def _sub_jaxpr(eqn: JaxprEqn) -> tuple[Any, tuple]:
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if inner is not None and hasattr(inner, "jaxpr"):
        return inner.jaxpr, tuple(inner.consts)
    return inner, ()


def capture(step: Callable, params: Any, opt_state: Any, batch: Any, fold_invariant_sums: bool = False) -> CapturedStep:
    """Trace ``step`` on example inputs and locate its shard_map body and mesh axis.

    ``fold_invariant_sums``: compute a ``psum`` of a device-invariant value as a product
    (see `flatten_calls`)."""
    try:
        closed, out_shape = jax.make_jaxpr(step, return_shape=True)(params, opt_state, batch)
    except NameError as err:  # lax.psum over an axis no mesh binds
        raise UnsupportedStepError(
            f"the step reduces over an axis that is not in its mesh ({err}); reduce gradients "
            "over the shard_map/pmap axis name"
        ) from None

    if not isinstance(out_shape, (tuple, list)) or len(out_shape) != 3:
        hint = ""
        if out_shape is None or not jax.tree.leaves(out_shape):
            hint = (
                " (an NNX train_step(model, optimizer, batch) that updates its objects in place is "
                "scheduled by jaxsched.integrations.nnx.schedule)"
            )
        raise UnsupportedStepError(
            f"the step must return (params, opt_state, aux); it returned {describe_outputs(out_shape)}{hint}"
        )
    params_tree = _structure(params)
    opt_tree = _structure(opt_state)
    for name, tree, given, out in (
        ("params", params_tree, params, out_shape[0]),
        ("opt_state", opt_tree, opt_state, out_shape[1]),
    ):
        if _structure(out) != tree:
            raise UnsupportedStepError(
                f"the step's output {name} differs from its input {name}: it has "
                f"{difference(given, out)}; the step must return {name} in the same structure it "
                f"takes (it returned {describe_outputs(out_shape)})"
            )
    num_params, num_opt = params_tree.num_leaves, opt_tree.num_leaves
    batch_tree = _structure(batch)
    aux_tree = _structure(out_shape[2])

    roles = (
        [Source("params", i) for i in range(num_params)]
        + [Source("opt_state", i) for i in range(num_opt)]
        + [Source("batch", i) for i in range(batch_tree.num_leaves)]
    )

    donates = donates_every_state_leaf(closed.jaxpr, roles, num_params + num_opt)
    # Walk through jit wrappers to the shard_map, tracking what feeds every variable.
    jaxpr = closed.jaxpr
    env: dict[Any, Source | tuple[str, Any]] = {v: src for v, src in zip(jaxpr.invars, roles)}
    env.update({v: ("const", c) for v, c in zip(jaxpr.constvars, closed.consts)})
    outs = list(jaxpr.outvars)
    while len(jaxpr.eqns) == 1 and jaxpr.eqns[0].primitive.name in CALL_PRIMITIVES:
        eqn = jaxpr.eqns[0]
        position = {v: i for i, v in enumerate(eqn.outvars)}
        if not all(isinstance(o, jex_core.Var) and o in position for o in outs):
            break  # an output bypasses the call: the shard_map check below explains
        inner, inner_consts = _sub_jaxpr(eqn)
        new_env = {}
        for v, operand in zip(inner.invars, eqn.invars):
            new_env[v] = ("const", operand.val) if isinstance(operand, jex_core.Literal) else env[operand]
        new_env.update({v: ("const", c) for v, c in zip(inner.constvars, inner_consts)})
        # the call may return its outputs in another order than the step (NNX's jit does)
        env, jaxpr, outs = new_env, inner, [inner.outvars[position[o]] for o in outs]

    shard_maps = [e for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    # a step on global arrays, or global work beside a shard_map (partitioning names the mix)
    if not shard_maps or len(jaxpr.eqns) != 1:
        return dataclasses.replace(
            _capture_global(
                closed,
                out_shape,
                (params, opt_state, batch),
                (params_tree, opt_tree, batch_tree, aux_tree),
                _names_state_paths(step),
            ),
            donates_state=donates,
        )
    eqn = shard_maps[0]

    sources: list = []
    consts: list = []
    for operand in eqn.invars:
        src = ("const", operand.val) if isinstance(operand, jex_core.Literal) else env[operand]
        if isinstance(src, tuple):
            sources.append(Source("const", len(consts)))
            consts.append(src[1])
        else:
            sources.append(src)
    out_index = {v: i for i, v in enumerate(eqn.outvars)}
    try:
        outputs = tuple(out_index[v] for v in outs)
    except (KeyError, TypeError):
        raise UnsupportedStepError("every output of the step must come out of its shard_map/pmap body") from None

    mesh = eqn.params["mesh"]
    user_body = eqn.params["jaxpr"]
    user_body = user_body.jaxpr if hasattr(user_body, "jaxpr") else user_body
    body = flatten_calls(
        user_body,
        mesh,
        eqn.params["in_specs"],
        eqn.params["out_specs"],
        [x.aval for x in eqn.invars],
        fold_invariant_sums,
    )
    manual = tuple(eqn.params.get("manual_axes", eqn.params.get("newly_manual_axes", mesh.axis_names)))
    axis_name = data_axes(mesh, eqn.params["in_specs"], sources, body)
    for a in as_axes(axis_name):
        if manual and a not in manual:
            raise UnsupportedStepError(f"mesh axis {a!r} is not manual in the shard_map")
    kind = "pmap" if _looks_like_pmap(eqn, body) else "shard_map"
    return CapturedStep(
        kind=kind,
        body=body,
        user_body=user_body,
        sources=tuple(sources),
        consts=tuple(consts),
        outputs=outputs,
        mesh=mesh,
        axis_name=axis_name,
        axis_size=axis_size(mesh, axis_name),
        in_specs=tuple(eqn.params["in_specs"]),
        out_specs=tuple(eqn.params["out_specs"]),
        params_tree=params_tree,
        opt_tree=opt_tree,
        batch_tree=batch_tree,
        aux_tree=aux_tree,
        num_params=num_params,
        num_opt=num_opt,
        num_batch=batch_tree.num_leaves,
        check_vma=bool(eqn.params.get("check_vma", False)),
        example_inputs=jax.tree.map(abstract_leaf, (params, opt_state, batch)),
        state_outputs=_state_outputs(out_shape),
        donates_state=donates,
    )


def donates_every_state_leaf(jaxpr: jex_core.Jaxpr, roles: list[Source], num_state: int) -> bool:
    """Whether the step's jit (or pmap) wrapper, outermost first through single-call
    wrappers, donates every params and opt_state leaf. A step that donates part of its
    state keeps the rest: the scheduled program, whose state is laid out its own way
    (``dear``'s packed shards), then donates none.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> step = jax.jit(lambda p, o, b: (p + b, o, b.sum()), donate_argnums=(0, 1))
        >>> closed = jax.make_jaxpr(step)(jnp.ones(2), jnp.ones(2), jnp.ones(2))
        >>> roles = [Source("params", 0), Source("opt_state", 0), Source("batch", 0)]
        >>> donates_every_state_leaf(closed.jaxpr, roles, 2)
        True
    """
    wanted = set(roles[:num_state])
    if not wanted:
        return False
    env: dict[Any, Any] = dict(zip(jaxpr.invars, roles))
    donated: set = set()
    while len(jaxpr.eqns) == 1 and jaxpr.eqns[0].primitive.name in CALL_PRIMITIVES | {"xla_pmap"}:
        eqn = jaxpr.eqns[0]
        flags = eqn.params.get("donated_invars") or (False,) * len(eqn.invars)
        donated |= {env.get(v) for v, flag in zip(eqn.invars, flags) if flag and isinstance(v, jex_core.Var)}
        if wanted <= donated:
            return True
        try:
            inner, _ = _sub_jaxpr(eqn)
        except (KeyError, TypeError):
            return False
        env = {w: env.get(v) if isinstance(v, jex_core.Var) else None for w, v in zip(inner.invars, eqn.invars)}
        jaxpr = inner
    return False


def _state_outputs(out_shape: Any) -> tuple:
    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves((out_shape[0], out_shape[1])))


#: Set on a step whose params and opt_state are dicts keyed by the paths of the user's state
#: (the state-form adapter's pure step): its leaves are named by those paths.
STATE_PATHS_ATTRIBUTE = "jaxsched_state_paths"


def _leaf_names(role: str, tree: Any, state_paths: bool = False) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    if state_paths and role != "batch":
        return ["state/" + str(getattr(path[0], "key", path[0])) for path, _ in flat]
    return [role + jax.tree_util.keystr(path) for path, _ in flat]


def _names_state_paths(step: Callable) -> bool:
    """Whether ``step`` (or a function it wraps) is marked with `STATE_PATHS_ATTRIBUTE`."""
    fn: Callable | None = step
    seen = 0
    while fn is not None and seen < 16:
        if getattr(fn, STATE_PATHS_ATTRIBUTE, False):
            return True
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def _capture_global(closed, out_shape: Any, inputs: tuple, trees: tuple, state_paths: bool = False) -> CapturedStep:
    """A step on global arrays (``jax.jit`` with shardings), partitioned per device."""
    from jaxsched.core import partition

    params, opt_state, batch = inputs
    params_tree, opt_tree, batch_tree, aux_tree = trees
    leaves = jax.tree.leaves(inputs)
    names = (
        _leaf_names("params", params, state_paths)
        + _leaf_names("opt_state", opt_state, state_paths)
        + _leaf_names("batch", batch)
    )
    roles = (
        ["params"] * params_tree.num_leaves + ["opt_state"] * opt_tree.num_leaves + ["batch"] * batch_tree.num_leaves
    )
    n_state = params_tree.num_leaves + opt_tree.num_leaves
    try:
        part = partition.partition(closed, leaves, names, roles, n_state)
    except (partition.PlacementError, partition.PartitionError) as err:
        raise UnsupportedStepError(str(err)) from None
    placement = part.placement
    sources = [
        Source(role, i)
        for role, tree in (("params", params_tree), ("opt_state", opt_tree), ("batch", batch_tree))
        for i in range(tree.num_leaves)
    ]
    sources += [Source("const", c) for c in range(len(part.const_values))]
    return CapturedStep(
        kind="jit",
        body=part.body,
        user_body=part.body,
        sources=tuple(sources),
        consts=part.const_values,
        outputs=tuple(range(len(closed.jaxpr.outvars))),
        mesh=placement.mesh,
        axis_name=placement.axis_name,
        axis_size=placement.axis_size,
        in_specs=part.in_specs,
        out_specs=part.out_specs,
        params_tree=params_tree,
        opt_tree=opt_tree,
        batch_tree=batch_tree,
        aux_tree=aux_tree,
        num_params=params_tree.num_leaves,
        num_opt=opt_tree.num_leaves,
        num_batch=batch_tree.num_leaves,
        check_vma=False,
        example_inputs=jax.tree.map(abstract_leaf, inputs),
        global_step=closed,
        gathers=part.gathers,
        state_outputs=_state_outputs(out_shape),
        manual_axes=placement.manual_axes,
    )


def flatten_calls(body, mesh: Mesh, in_specs, out_specs, operand_avals, fold_invariant_sums: bool = False) -> Any:
    """The body with nested jit and custom_jvp/vjp calls inlined, re-traced as one jaxpr.

    A user who jits the loss (or Flax/optax code that jits internally) hides forward and
    backward inside one call equation, whose gradients all appear at once when it
    returns; inlined, each gradient appears where backward computes it, so buckets can
    be reduced while backward continues. ``check_vma`` typing (``pvary``,
    ``psum_invariant``) is translated on the way (`jaxsched.core._replay`). With
    ``fold_invariant_sums``, a ``psum`` of a value every device already holds (a ``pmean``
    on top of the reduction JAX does in backward) becomes a product, not an all-reduce.
    """
    if body.constvars or not any(
        e.primitive.name in CALL_PRIMITIVES | VMA_TYPING | {"psum_invariant"} for e in body.eqns
    ):
        return body

    run = replay.invariant_sums_as_products(dict(mesh.shape)) if fold_invariant_sums else replay.bind

    def replayed(*args):
        return tuple(replay.eval_inline(body, [], args, run))

    mapped = jax.shard_map(replayed, mesh=mesh, in_specs=tuple(in_specs), out_specs=tuple(out_specs), check_vma=False)
    args = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
        for a, spec in zip(operand_avals, in_specs)
    ]
    traced = jax.make_jaxpr(mapped)(*args).jaxpr
    (inner,) = [e for e in traced.eqns if e.primitive.name == "shard_map"]
    flat = inner.params["jaxpr"]
    return flat.jaxpr if hasattr(flat, "jaxpr") else flat


def abstract_leaf(a: Any) -> jax.ShapeDtypeStruct:
    """Shape, dtype and (for arrays placed by the user) sharding: what tracing needs.

    An array JAX left uncommitted (``optax.adam``'s ``count`` from ``tx.init``: on the
    default device, never placed) has no sharding here, as ``jax.jit`` moves it wherever
    the step needs it; kept, it would read as committed to one device."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return a
    committed = isinstance(a, jax.Array) and getattr(a, "committed", True)
    sharding = a.sharding if committed else None
    dtype = a.dtype if hasattr(a, "dtype") else jax.numpy.asarray(a).dtype
    return jax.ShapeDtypeStruct(jax.numpy.shape(a), dtype, sharding=sharding)


def data_axes(mesh: Mesh, in_specs: Any, sources: Any, body: Any) -> str | tuple[str, ...]:
    """The data-parallel axis of a step: the mesh axes its batch is sharded over.

    One axis comes back as its name, several as a tuple in the order the batch's spec
    names them (``P(("dcn", "ici"))``: that order lays out devices, and every collective
    over the tuple follows it). Other mesh axes (tensor or expert parallel) are model
    axes: their collectives stay where the user wrote them. A step whose batch is not
    sharded falls back on the axes its reductions sum over, which must then be one.
    """
    found: list[str] = []
    for spec, src in zip(in_specs, sources):
        if src.role != "batch":
            continue
        found += [a for a in spec_axes(spec) if a not in found]
    if found:
        return found[0] if len(found) == 1 else tuple(found)
    reduced = _reduction_axes(body)
    candidates = [a for a in mesh.axis_names if a in reduced] or list(mesh.axis_names)
    if len(candidates) != 1:
        raise UnsupportedStepError(
            f"the mesh has axes {mesh.axis_names} and the batch is not sharded over any of them, "
            f"so the data-parallel axis is ambiguous (the step reduces over {sorted(reduced)}); "
            "shard the batch over the data-parallel axes (in_specs P('data') or P(('dcn', 'ici')))"
        )
    return candidates[0]


def _reduction_axes(jaxpr) -> set:
    return {
        a
        for eqn in replay.nested_eqns(jaxpr)
        if eqn.primitive.name in REDUCTIONS
        for a in reduction_axes(eqn)
        if isinstance(a, str)
    }


def _looks_like_pmap(eqn: JaxprEqn, body: jex_core.Jaxpr) -> bool:
    """pmap bodies take a (1, ...) block of every mapped input and only squeeze it. Inputs
    that are not mapped, an ``in_axes=None`` argument or a constant JAX hoisted into the
    body (a position table), come in whole with spec ``P()``: they say nothing either way."""
    specs = eqn.params["in_specs"]
    mapped = {v for v, s in zip(body.invars, specs) if len(s) >= 1 and s[0] is not None}
    if not mapped or any(v not in mapped and spec_axes(s) for v, s in zip(body.invars, specs)):
        return False
    if any(tuple(replay.aval_of(v).shape[:1]) != (1,) for v in mapped):
        return False
    return all(
        e.primitive.name == "squeeze" and tuple(e.params["dimensions"]) == (0,)
        for e in body.eqns
        if any(isinstance(x, jex_core.Var) and x in mapped for x in e.invars)
    )
