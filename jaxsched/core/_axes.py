"""Data-parallel axes: one mesh axis, or several (slices and chips, hosts and local devices).

A step's data-parallel axis is what its batch is sharded over
(`jaxsched.core._capture.data_axes`): a mesh axis name such as ``"data"``, or a tuple such
as ``("dcn", "ici")`` when data parallelism spans two levels of the network. JAX's
collectives accept either (``lax.psum(x, ("dcn", "ici"))`` sums over both; a tiled
``psum_scatter`` over the tuple hands device ``dcn * n_ici + ici`` its slice), so most of
the pipeline passes the name through. These helpers answer the rest.

Example:
    >>> import jax
    >>> mesh = jax.make_mesh((2, 4), ("dcn", "ici"), devices=jax.devices()[:8])
    >>> as_axes("data"), axis_size(mesh, ("dcn", "ici")), axis_size(mesh, "ici")
    (('data',), 8, 4)
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["AxisName", "as_axes", "axis_size", "num_slices", "spec_axes"]

#: One mesh axis name, or a tuple of them.
AxisName = str | tuple[str, ...]


def as_axes(axis: Any) -> tuple:
    """``axis`` (one mesh axis name or a tuple of them) as a tuple of names."""
    return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def spec_axes(spec: Any) -> tuple[str, ...]:
    """Every mesh axis a ``PartitionSpec`` shards over, in the order it names them.

    >>> from jax.sharding import PartitionSpec as P
    >>> spec_axes(P(("dcn", "ici"), None, "model"))
    ('dcn', 'ici', 'model')
    """
    return tuple(a for dim in spec if dim is not None for a in as_axes(dim))


def axis_size(mesh: Any, axis: Any) -> int:
    """Devices along ``axis`` (the product over a tuple of mesh axes)."""
    return math.prod(mesh.shape[a] for a in as_axes(axis))


def num_slices(devices: Any) -> int:
    """How many TPU slices (joined over DCN) ``devices`` sit in; 1 for devices without a
    ``slice_index`` (GPU, CPU, one slice)."""
    return len({getattr(d, "slice_index", 0) or 0 for d in devices})
