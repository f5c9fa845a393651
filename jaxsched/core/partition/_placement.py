"""Where a ``jax.jit`` step's inputs live: the mesh, the data axes, each leaf's spec.

The **data axes** are the mesh axes the batch is split over (the axes of each batch leaf's
first sharded dimension). Every other mesh axis of size above one is a **model axis**
(tensor or expert parallelism): its sharding stays XLA's to partition, inside a
``shard_map`` manual over the data axes only. Mesh axes of size one shard nothing and are
dropped from every spec: ``P('fsdp', 'tensor')`` on a mesh where both are 1 is replicated.

A parameter or optimizer-state leaf may be sharded over data axes along one dimension:
FSDP (over every data axis) or HSDP (over some, replicated over the others). It becomes a
parameter block (`block`), gathered where a rule needs it
whole and updated as a block; its model axes stay as the user placed them.

The placement of an input is read, in this order, from the ``in_shardings`` given to
``jax.jit``, from the array's own sharding, and from its abstract value under an
``Explicit`` mesh; the mesh from those shardings, or from ``jax.set_mesh``. Leaves on one
device (or plain NumPy arrays, with no mesh anywhere) run on a one-device mesh.

Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("data",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    >>> x = jax.device_put(np.ones((4, 4), np.float32), NamedSharding(mesh, P("data")))
    >>> closed = jax.make_jaxpr(lambda w, x: x @ w)(np.ones((4, 2), np.float32), x)
    >>> w = jax.device_put(np.ones((4, 2), np.float32), NamedSharding(mesh, P("data")))
    >>> placed = read_placement(closed, [w, x], ["params/w", "batch[0]"], ["params", "batch"])
    >>> placed.axis_name, placed.specs, placed.kinds
    ('data', (P('data',), P('data',)), (B(0:data), S(0)))
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched._errors import JaxschedError, UnshardedStepWarning
from jaxsched.core._axes import AxisName, as_axes, axis_size
from jaxsched.core.partition._kinds import Kind, REPLICATED, block, sharded
from jaxsched.core._replay import nested_eqns

__all__ = ["Placement", "PlacementError", "manual_spec", "read_placement", "unplaced_inputs", "without_unit_axes"]


class PlacementError(JaxschedError, ValueError):
    """The inputs' placement is not data parallelism jaxsched can schedule; says why."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Attributes:
    mesh: the concrete mesh every input lives on.
    split_inside: whether the data axes were read from a sharding constraint inside the
      step, the batch arriving whole.
    axis_name: the data axes (one name, or a tuple in the order the batch spec names them).
    specs: per flat input leaf, its ``PartitionSpec`` (data and model axes; size-1 axes dropped).
    kinds: per flat input leaf, what one device holds of it along the data axes.
    manual_axes: the axes the per-device program is manual over: the data axes when the mesh
      has model axes (above size one), else None (every axis, as a plain ``shard_map``).
    """

    mesh: Mesh
    axis_name: AxisName
    specs: tuple[P, ...]
    kinds: tuple[Kind, ...]
    manual_axes: tuple[str, ...] | None = None
    #: the batch comes in whole and the step splits it with a sharding constraint (EasyLM's
    #: ``with_sharding_constraint(batch, P(('dp', 'fsdp')))``), which names the data axes
    split_inside: bool = False

    @property
    def axis_size(self) -> int:
        return axis_size(self.mesh, self.axis_name)

    @property
    def axis_sizes(self) -> tuple[tuple[str, int], ...]:
        return tuple((a, int(self.mesh.shape[a])) for a in as_axes(self.axis_name))


def without_unit_axes(spec: P, mesh: Mesh) -> P:
    """``spec`` without the mesh axes of size one (they shard nothing), trailing Nones dropped."""
    entries = []
    for entry in spec:
        axes = tuple(a for a in as_axes(entry) if entry is not None and mesh.shape[a] > 1) if entry is not None else ()
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def manual_spec(spec: P, manual: Any) -> P:
    """``spec`` restricted to the ``manual`` axes (None: every axis): what a ``shard_map``
    manual over those axes takes; the other axes are XLA's to partition."""
    if manual is None:
        return spec
    keep = set(manual)
    entries = []
    for entry in spec:
        axes = tuple(a for a in as_axes(entry) if a in keep) if entry is not None else ()
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _top_shardings(closed) -> list:
    """``jax.jit(..., in_shardings=...)`` of the step, when its jaxpr is that one call."""
    jaxpr = closed.jaxpr
    if (
        len(jaxpr.eqns) == 1
        and "in_shardings" in jaxpr.eqns[0].params
        and list(jaxpr.eqns[0].invars) == list(jaxpr.invars)
    ):
        return list(jaxpr.eqns[0].params["in_shardings"])
    return [None] * len(jaxpr.invars)


def _top_out_shardings(closed, num_state_outputs: int) -> list:
    """How the step lays out its state outputs (the first ``num_state_outputs``, in the
    order of the first inputs): ``jax.jit(..., out_shardings=...)``, else a
    ``lax.with_sharding_constraint`` that returns the leaf; None where neither says.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> blocks = NamedSharding(mesh, P("fsdp"))
        >>> step = jax.jit(lambda w: jax.lax.with_sharding_constraint(w * 2, blocks))
        >>> [s.spec for s in _top_out_shardings(jax.make_jaxpr(step)(jnp.ones(8)), 1)]
        [P('fsdp',)]
    """
    jaxpr = closed.jaxpr
    found: list = [None] * num_state_outputs
    if (
        num_state_outputs
        and len(jaxpr.eqns) == 1
        and "out_shardings" in jaxpr.eqns[0].params
        and list(jaxpr.eqns[0].invars) == list(jaxpr.invars)
        and list(jaxpr.eqns[0].outvars) == list(jaxpr.outvars)
    ):
        inner = jaxpr.eqns[0].params["jaxpr"].jaxpr
        constrained = {
            e.outvars[0]: e.params["sharding"] for e in inner.eqns if e.primitive.name == "sharding_constraint"
        }
        out = list(jaxpr.eqns[0].params["out_shardings"])[:num_state_outputs]
        for i, (given, var) in enumerate(zip(out, inner.outvars)):
            chosen = given if isinstance(given, NamedSharding) else constrained.get(var)
            found[i] = chosen if isinstance(chosen, NamedSharding) else None
    return found


def unplaced_inputs(closed, leaves: Sequence[Any]) -> set[int]:
    """The flat inputs that nothing places on a mesh: host arrays, single-device arrays, and
    no ``in_shardings`` for them (``jax.jit(tx.init)(params)`` leaves the moments so). The
    plain step returns such a leaf as XLA's propagation shards it, not as it came in.

    Args:
      closed: the step's closed jaxpr.
      leaves: its flat inputs.

    Returns:
      Their indices.
    """
    given = _top_shardings(closed)
    return {
        i
        for i, (g, leaf) in enumerate(zip(given, leaves, strict=True))
        if not isinstance(g, jax.sharding.Sharding)
        and not isinstance(getattr(leaf, "sharding", None), NamedSharding)
        and not (getattr(leaf, "sharding", None) is None and _sharding_of(None, leaf, closed.jaxpr.invars[i].aval))
    }


def _sharding_of(given: Any, leaf: Any, aval: Any) -> Any:
    if isinstance(given, jax.sharding.Sharding):
        return given
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if spec is not None and any(d is not None for d in spec):
        return spec  # an Explicit mesh's abstract value: the mesh comes from elsewhere
    return None


def _concrete_mesh(shardings: Sequence[Any]) -> Mesh | None:
    meshes = []
    for s in shardings:
        mesh = getattr(s, "mesh", None)
        if isinstance(mesh, Mesh) and mesh.axis_names and mesh not in meshes:
            meshes.append(mesh)
    if len(meshes) > 1:
        devices = {frozenset(m.devices.flat) for m in meshes}
        shapes = {tuple(m.shape.items()) for m in meshes}
        if len(devices) > 1 or len(shapes) > 1:
            raise PlacementError(
                f"the step's inputs live on different meshes ({meshes[0]} and "
                f"{meshes[1]}); place every input on one mesh"
            )
    if meshes:
        return meshes[0]
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:
        mesh = None
    if isinstance(mesh, Mesh) and mesh.axis_names:
        return mesh
    return None


def _single_device_mesh(shardings: Sequence[Any], leaves: Sequence[Any]) -> Mesh:
    devices = set()
    for s, leaf in zip(shardings, leaves):
        if isinstance(s, jax.sharding.Sharding):
            devices |= set(s.device_set)
    if len(devices) > 1:
        raise PlacementError(
            "the step's inputs are spread over several devices without a NamedSharding; place the "
            "batch with jax.device_put(batch, NamedSharding(mesh, P('data'))) and the parameters "
            "with P()"
        )
    if jax.device_count() > 1:
        warnings.warn(
            f"no input of the step is sharded over a mesh, so it runs on one device of the "
            f"{jax.device_count()} available: nothing is parallelised or scheduled. Split the batch "
            "over the devices with jax.device_put(batch, NamedSharding(mesh, P('data'))), "
            f"mesh = jax.make_mesh(({jax.device_count()},), ('data',))",
            UnshardedStepWarning,
            stacklevel=2,
        )
    device = devices.pop() if devices else jax.devices()[0]
    return Mesh(np.array([device]), ("data",))


def _spec_of(sharding: Any) -> P:
    if sharding is None:
        return P()
    if isinstance(sharding, P):
        return sharding
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    if isinstance(sharding, jax.sharding.SingleDeviceSharding) or sharding.is_fully_replicated:
        return P()
    raise PlacementError(
        f"an input has a {type(sharding).__name__}; jaxsched reads placements "
        "from NamedSharding (jax.sharding.NamedSharding(mesh, PartitionSpec(...)))"
    )


def _sharded_dims(spec: P) -> list[tuple[int, tuple[str, ...]]]:
    return [(d, as_axes(entry)) for d, entry in enumerate(spec) if entry is not None and as_axes(entry)]


def _data_axes(names, roles, specs) -> tuple[str, ...] | None:
    """The axes of each batch leaf's first sharded dimension; they must agree."""
    data: tuple[str, ...] | None = None
    for name, role, spec in zip(names, roles, specs):
        dims = _sharded_dims(spec)
        if role != "batch" or not dims:
            continue
        axes = dims[0][1]
        if data is None:
            data = axes
        elif axes != data:
            raise PlacementError(
                f"{name} is sharded over {axes}, other batch leaves over "
                f"{data}; shard every batch leaf's batch dimension over the same data axes"
            )
    return data


def _what(name: str, role: str) -> str:
    """What a state leaf is, for messages: its role, or (a state-form step's leaf, every one in
    the role of a parameter) its path's."""
    if role == "opt_state" or "opt_state" in name.split("/")[:2] or name.startswith("opt_state"):
        return "an optimizer-state leaf"
    return "a parameter"


def _leaf_kind(name: str, role: str, shape: tuple, spec: P, data: tuple[str, ...], mesh: Mesh) -> Kind:
    """What one device holds of a state leaf: replicated over the data axes, or a block."""
    in_data = [(d, tuple(a for a in axes if a in data)) for d, axes in _sharded_dims(spec)]
    in_data = [(d, axes) for d, axes in in_data if axes]
    if not in_data:
        return REPLICATED
    if len(in_data) > 1:
        raise PlacementError(
            f"{name} is sharded with {spec}: over the data axes {data} along "
            f"{len(in_data)} dimensions; jaxsched splits {_what(name, role)} over the data axes along one "
            "dimension (FSDP): shard one dimension over them and keep the others replicated or on "
            "model axes"
        )
    d, axes = in_data[0]
    mixed = [a for a in as_axes(spec[d]) if a not in data]
    if mixed:
        raise PlacementError(
            f"{name} is sharded with {spec}: its dimension {d} mixes the data axes {axes} with "
            f"the model axes {tuple(mixed)}; shard a dimension over data axes or over model "
            "axes, not both"
        )
    size = axis_size(mesh, axes)
    if d >= len(shape) or shape[d] % size:
        raise PlacementError(
            f"{name} has shape {tuple(shape)} and is sharded with {spec}: its dimension {d} does "
            f"not split evenly over the {size} devices of {axes if len(axes) > 1 else axes[0]!r}. "
            f"Pad that dimension to a multiple of {size}, or shard another dimension (or none)"
        )
    return block(d, axes)


def read_placement(
    closed, leaves: Sequence[Any], names: Sequence[str], roles: Sequence[str], num_state_outputs: int = 0
) -> Placement:
    """The placement of the step traced as ``closed`` on flat input ``leaves`` (named
    ``names``, of role ``"params"``, ``"opt_state"`` or ``"batch"``). Raises
    `PlacementError` naming the first leaf that is not data parallel.

    A state leaf (one of the first ``num_state_outputs`` inputs, which the step returns in
    the same order) is placed as the step's ``out_shardings`` returns it, where the jit
    gives them, or as a ``lax.with_sharding_constraint`` returns it: the scheduled state
    keeps one layout, the one the plain step returns."""
    given = _top_shardings(closed)
    for i, out in enumerate(_top_out_shardings(closed, num_state_outputs)):
        if out is not None:
            given[i] = out
    shardings = [_sharding_of(g, leaf, v.aval) for g, leaf, v in zip(given, leaves, closed.jaxpr.invars, strict=True)]
    mesh = _concrete_mesh(shardings)
    if mesh is None:
        if any(isinstance(s, P) for s in shardings):
            raise PlacementError(
                "the step's inputs carry PartitionSpecs of an Explicit mesh, but "
                "no concrete mesh is known; place them with NamedSharding or call "
                "the step under jax.set_mesh(mesh)"
            )
        mesh = _single_device_mesh(shardings, leaves)
        specs = [P()] * len(leaves)
    else:
        specs = [without_unit_axes(_spec_of(s), mesh) for s in shardings]

    data = _data_axes(names, roles, specs)
    split_inside = False
    if data is None and mesh.devices.size > 1:
        data = constrained_data_axes(closed, roles, mesh)
        split_inside = data is not None
    if data is None:
        if mesh.devices.size > 1:
            raise PlacementError(
                f"no batch leaf is sharded over the mesh {dict(mesh.shape)}, so the data-parallel "
                "axis is unknown; place the batch with jax.device_put(batch, NamedSharding(mesh, "
                f"P({mesh.axis_names[0]!r}))) over the axes it is split over"
            )
        data = (mesh.axis_names[0],)
    axis_name: AxisName = data[0] if len(data) == 1 else data
    size = axis_size(mesh, axis_name)
    model = tuple(a for a in mesh.axis_names if a not in data and mesh.shape[a] > 1)
    kinds, final_specs = [], []
    for name, leaf, role, spec in zip(names, leaves, roles, specs):
        dims = _sharded_dims(spec)
        shape = tuple(np.shape(leaf))
        if role == "batch" and dims and dims[0][1] == data:
            d = dims[0][0]
            if len(shape) <= d or shape[d] % size:
                raise PlacementError(
                    f"{name} has shape {tuple(shape)}, whose dimension {d} does not "
                    f"split evenly over the {size} devices of {axis_name!r}"
                )
            if any(a in data for _, axes in dims[1:] for a in axes):
                raise PlacementError(
                    f"{name} is sharded with {spec}: the data axes {data} appear on more than "
                    "its batch dimension; shard one dimension of each batch leaf over them"
                )
            kinds.append(sharded(d))
            final_specs.append(spec)
        elif role == "batch" and size == 1 and len(shape) >= 1 and not dims:
            kinds.append(sharded(0))  # one device: a block is the whole leaf
            final_specs.append(P(axis_name))
        elif role == "batch":
            if any(a in data for _, axes in dims for a in axes):
                raise PlacementError(
                    f"{name} is sharded with {spec}, other batch leaves over {data} along their "
                    "batch dimension; shard every batch leaf's batch dimension over the same data axes"
                )
            kinds.append(REPLICATED)
            final_specs.append(spec)
        else:
            kinds.append(_leaf_kind(name, role, shape, spec, data, mesh))
            final_specs.append(spec)
    manual = tuple(data) if model else None
    return Placement(mesh, axis_name, tuple(final_specs), tuple(kinds), manual, split_inside)


def constraint_spec(eqn: Any, mesh: Mesh) -> P | None:
    """The ``PartitionSpec`` a ``with_sharding_constraint`` or ``reshard`` equation places its
    operand with (size-one axes dropped), or None for any other equation."""
    if eqn.primitive.name not in ("sharding_constraint", "reshard"):
        return None
    sharding = eqn.params.get("dst_sharding" if eqn.primitive.name == "reshard" else "sharding")
    spec = getattr(sharding, "spec", sharding if isinstance(sharding, P) else None)
    if spec is None:
        return None
    try:
        return without_unit_axes(spec, mesh)
    except KeyError:  # an axis of another mesh
        return None


def constrained_data_axes(closed: Any, roles: Sequence[str], mesh: Mesh) -> tuple[str, ...] | None:
    """The data axes of a step that splits its batch itself: the axes the first sharding
    constraint on a value computed from the batch splits its leading dimension over (a
    constraint on any value, where none is on the batch's)."""
    derived = {v for v, role in zip(closed.jaxpr.invars, roles) if role == "batch"}
    fallback = None
    for eqn in closed.jaxpr.eqns:
        if any(isinstance(x, jex_core.Var) and x in derived for x in eqn.invars):
            derived.update(eqn.outvars)
        spec = constraint_spec(eqn, mesh)
        dims = _sharded_dims(spec) if spec is not None else []
        if dims and dims[0][0] == 0 and eqn.invars[0] in derived:
            return dims[0][1]
    for eqn in nested_eqns(closed.jaxpr):
        spec = constraint_spec(eqn, mesh)
        dims = _sharded_dims(spec) if spec is not None else []
        if dims and dims[0][0] == 0:
            fallback = fallback or dims[0][1]
    return fallback
