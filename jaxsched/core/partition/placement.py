"""Where a ``jax.jit`` step's inputs live: the mesh, the data axes, each leaf's spec.

Data parallelism written with shardings keeps parameters and optimizer state replicated
(``P()``) and shards each batch leaf's leading (or another) dimension over one or several
mesh axes: those are the data axes. The placement of an input is read, in this order,
from the ``in_shardings`` given to ``jax.jit``, from the array's own sharding, and from
its abstract value under an ``Explicit`` mesh; the mesh from those shardings, or from
``jax.set_mesh``. Leaves on one device (or plain NumPy arrays, with no mesh anywhere) run
on a one-device mesh.

Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("data",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    >>> x = jax.device_put(np.ones((4, 3), np.float32), NamedSharding(mesh, P("data")))
    >>> closed = jax.make_jaxpr(lambda w, x: x @ w)(np.ones((3, 2), np.float32), x)
    >>> placed = read_placement(closed, [np.ones((3, 2)), x], ["params/w", "batch[0]"], ["params", "batch"])
    >>> placed.axis_name, placed.specs
    ('data', (P(), P('data',)))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched.core.axes import AxisName, as_axes, axis_size
from jaxsched.core.partition.kinds import Kind, REPLICATED, sharded

__all__ = ["Placement", "PlacementError", "read_placement"]

#: The forms jaxsched schedules, for refusals.
SHARD_MAP_FORM = (
    "jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P('data')), out_specs=P()) "
    "with lax.pmean(grads, 'data') inside, and the parameter blocks passed with "
    "their model-axis specs"
)


class PlacementError(ValueError):
    """The inputs' placement is not data parallelism jaxsched can schedule; says why."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Attributes:
    mesh: the concrete mesh every input lives on.
    axis_name: the data axes (one name, or a tuple in the order the batch spec names them).
    specs: per flat input leaf, its ``PartitionSpec``.
    kinds: per flat input leaf, what one device holds of it.
    """

    mesh: Mesh
    axis_name: AxisName
    specs: tuple[P, ...]
    kinds: tuple[Kind, ...]

    @property
    def axis_size(self) -> int:
        return axis_size(self.mesh, self.axis_name)


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


def read_placement(closed, leaves: Sequence[Any], names: Sequence[str], roles: Sequence[str]) -> Placement:
    """The placement of the step traced as ``closed`` on flat input ``leaves`` (named
    ``names``, of role ``"params"``, ``"opt_state"`` or ``"batch"``). Raises
    :class:`PlacementError` naming the first leaf that is not data parallel."""
    given = _top_shardings(closed)
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
        specs = [_spec_of(s) for s in shardings]

    data: tuple[str, ...] | None = None
    for name, role, spec in zip(names, roles, specs):
        dims = _sharded_dims(spec)
        if role != "batch":
            if dims:
                raise PlacementError(
                    f"{name} is sharded with {spec}: jaxsched schedules jax.jit steps whose "
                    "parameters and optimizer state are replicated (P()) and whose batch is "
                    "sharded over the data axes. A step with sharded parameters (FSDP, tensor "
                    f"parallelism) is scheduled in the shard_map form: {SHARD_MAP_FORM}"
                )
            continue
        if len(dims) > 1:
            raise PlacementError(
                f"{name} is sharded over several dimensions ({spec}); jaxsched "
                "shards each batch leaf over the data axes along one dimension"
            )
        for _, axes in dims:
            if data is None:
                data = axes
            elif axes != data:
                raise PlacementError(
                    f"{name} is sharded over {axes}, other batch leaves over "
                    f"{data}; shard every batch leaf over the same data axes"
                )
    if data is None:
        if mesh.devices.size > 1:
            raise PlacementError(
                f"no batch leaf is sharded over the mesh {dict(mesh.shape)}, so the data-parallel "
                "axis is unknown; place the batch with jax.device_put(batch, NamedSharding(mesh, "
                "P('data')))"
            )
        data = (mesh.axis_names[0],)
    axis_name: AxisName = data[0] if len(data) == 1 else data
    size = axis_size(mesh, axis_name)
    kinds, final_specs = [], []
    for name, leaf, role, spec in zip(names, leaves, roles, specs):
        dims = _sharded_dims(spec)
        shape = np.shape(leaf)
        if role == "batch" and dims:
            d = dims[0][0]
            if len(shape) <= d or shape[d] % size:
                raise PlacementError(
                    f"{name} has shape {tuple(shape)}, whose dimension {d} does not "
                    f"split evenly over the {size} devices of {axis_name!r}"
                )
            kinds.append(sharded(d))
            final_specs.append(spec)
        elif role == "batch" and size == 1 and len(shape) >= 1:
            kinds.append(sharded(0))  # one device: a block is the whole leaf
            final_specs.append(P(axis_name))
        else:
            kinds.append(REPLICATED)
            final_specs.append(P())
    return Placement(mesh, axis_name, tuple(final_specs), tuple(kinds))
