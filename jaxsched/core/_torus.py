"""Reduce-scatters that XLA:TPU keeps: at most two torus dimensions per group.

Private: the mesh-torus logic that the partition stage and the runtime's collectives share
(`jaxsched.runtime.collectives._torus` re-exports it).

XLA:TPU's ``reduce-scatter-decomposer`` (after layout assignment) rewrites a reduce-scatter
whose devices span three dimensions of the chip torus (every chip of ``v5p:2x2x2``, a data
axis over a whole 3-D slice) into an all-reduce of the whole buffer and a ``dynamic-slice``
of it: ``P`` times the bytes a device keeps, the traffic of a full all-reduce.
Over a line or a plane of chips (two of the three dimensions at most) the reduce-scatter
stays one (an all-reduce-scatter fusion). Measured with libtpu 0.0.42.1 on compile-only
``v5p`` devices (``2x2x2``, ``2x2x4``, ``4x4x4``); every form of one reduce-scatter over
the whole 3-D group (tiled on any dimension, flat, untiled, and XLA's own SPMD partitioner's)
came out as the all-reduce, whatever the async-collective options.

A flat (1-D) reduce-scatter became the all-reduce over any group; the same buffer as rows
of 128 elements stays a reduce-scatter (`TPU_LANES`).

The same sum leaves each device the same slice in two reduce-scatters over subgroups:
with the data index ``d = o * I + i``, first over the devices that share ``i`` (each keeps
part ``o`` of ``O = P / I``), then over those that share ``o`` (part ``i`` of that part:
slice ``o * I + i = d``, what one tiled ``psum_scatter`` hands device ``d``). Each device
sends ``(1 - 1/O) N + (1 - 1/I) N / O = (1 - 1/P) N`` elements of an ``N``-element buffer, as
many as one reduce-scatter over all ``P``. `scatter_stages` picks ``I`` so that both
subgroups span at most two torus dimensions. A stage over pairs of chips runs as an
exchange of halves (`staged_psum_scatter`): XLA:TPU runs a reduce-scatter over two chips
synchronously, a collective-permute asynchronously.

Example:
    >>> import jax
    >>> scatter_stages(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]), "data")
    ()
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh

from jaxsched.core._axes import AxisName, as_axes

__all__ = [
    "MAX_TORUS_DIMS",
    "SMALL_TENSOR_BYTES",
    "TPU_LANES",
    "Stages",
    "block_scatter_stages",
    "scatter_lanes",
    "scatter_stages",
    "spanned_dims",
    "staged_psum_scatter",
]

#: Torus dimensions a reduce-scatter's group may span and stay a reduce-scatter on TPU.
MAX_TORUS_DIMS = 2

#: The row length a flat buffer is reduce-scattered as on TPU. XLA:TPU turns every 1-D
#: reduce-scatter into an all-reduce of the whole buffer and a slice of it (any group, any
#: size measured, up to 8 MiB); the same buffer as rows of 128 (the lane width) stays a
#: reduce-scatter once a device's slice holds some rows (32 rows of 128 floats did, 8 did not).
TPU_LANES = 128

#: Tensors up to this size that share a bucket go through the plain psum in one buffer; a
#: reduce-scatter of one stays one (XLA:TPU makes an all-reduce of so few rows anyway, and
#: one costs less than two stages).
SMALL_TENSOR_BYTES = 64 * 1024

#: Reduce-scatter stages: per stage, ``axis_index_groups`` over the data index.
Stages = tuple[tuple[tuple[int, ...], ...], ...]


def _position(device: jax.Device) -> tuple[int, ...] | None:
    coords = getattr(device, "coords", None)
    if coords is None:
        return None
    return tuple(int(c) for c in coords)


def spanned_dims(positions: np.ndarray) -> int:
    """Torus dimensions along which ``positions`` (``(devices, dims)``) differ: more than
    `MAX_TORUS_DIMS` and XLA:TPU turns a reduce-scatter into an all-reduce.

    Args:
      positions: the devices' torus coordinates, one row per device.

    Returns:
      How many coordinate columns are not constant.

    Example:
        >>> import numpy as np
        >>> from jaxsched.runtime.collectives import spanned_dims
        >>> spanned_dims(np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]))
        2
    """
    return int(np.sum(np.any(positions != positions[:1], axis=0)))


def _fits(rows: np.ndarray, groups: list[list[int]]) -> bool:
    """Whether every group of data indices spans at most `MAX_TORUS_DIMS` in every row
    (``rows``: per position on the other mesh axes, the devices' positions along the data
    index, ``(rows, P, dims)``)."""
    return all(spanned_dims(row[g]) <= MAX_TORUS_DIMS for row in rows for g in groups)


def _on_tpu(mesh: Mesh) -> bool:
    devices = np.asarray(mesh.devices)
    return devices.size > 0 and getattr(devices.flat[0], "platform", None) == "tpu"


def block_scatter_stages(mesh: Mesh | None, axes: AxisName, nbytes: int) -> Stages:
    """The stages a reduce-scatter of an ``nbytes`` gradient into its parameter's block over
    ``axes`` runs in (``()``: one reduce-scatter): `scatter_stages` for a tensor above
    `SMALL_TENSOR_BYTES` on a known ``mesh``."""
    if mesh is None or nbytes <= SMALL_TENSOR_BYTES:
        return ()
    return scatter_stages(mesh, axes)


def scatter_lanes(mesh: Mesh) -> int:
    """The row length flat buffers are reduce-scattered as on ``mesh`` (`TPU_LANES` on
    TPU, 0, flat, elsewhere): a flat reduce-scatter becomes an all-reduce on TPU.

    Args:
      mesh: the step's mesh.

    Returns:
      The row length, or 0 to keep buffers flat.

    Example:
        >>> import jax
        >>> from jaxsched.runtime.collectives import scatter_lanes
        >>> scatter_lanes(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]))  # CPU
        0
    """
    return TPU_LANES if _on_tpu(mesh) else 0


def scatter_stages(mesh: Mesh, axes: AxisName) -> Stages:
    """How a tiled reduce-scatter over ``axes`` (one mesh axis or a tuple, indexed row-major
    as ``psum_scatter`` does) stays reduce-scatters on ``mesh``'s TPU torus.

    Returns ``()`` where one reduce-scatter is kept (groups on a line or a plane of chips,
    another platform, devices without ``coords``, groups that cross slices, whose
    collectives XLA:TPU builds in two levels itself) or no split fits; else two stages of
    ``axis_index_groups``: over the data indices ``{i, I + i, ...}``, then over
    ``{o * I, ..., o * I + I - 1}`` (module docstring).

    Args:
      mesh: the step's mesh.
      axes: the data-parallel axis name or names.

    Returns:
      The stages, as `Stages`.

    Example:
        >>> import jax
        >>> from jaxsched.runtime.collectives import scatter_stages
        >>> scatter_stages(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]), "data")  # CPU
        ()
    """
    axes = as_axes(axes)
    if not _on_tpu(mesh):
        return ()
    devices = np.asarray(mesh.devices)
    names = list(mesh.axis_names)
    if not all(a in names for a in axes):
        return ()
    positions = [p for p in map(_position, devices.flat) if p is not None]
    if len(positions) != devices.size or len({len(p) for p in positions}) != 1:
        return ()
    others = [k for k, a in enumerate(names) if a not in axes]
    order = others + [names.index(a) for a in axes]
    size = int(np.prod([mesh.shape[a] for a in axes]))
    grid = np.transpose(devices, order).reshape(-1, size)
    slices = np.vectorize(lambda d: getattr(d, "slice_index", 0) or 0, otypes=[np.int64])(grid)
    if np.any(slices != slices[:, :1]):
        return ()
    rows = np.array([[_position(d) for d in row] for row in grid])
    if _fits(rows, [list(range(size))]):
        return ()
    for inner in sorted((i for i in range(2, size) if size % i == 0), reverse=True):
        outer = size // inner
        first = [[o * inner + i for o in range(outer)] for i in range(inner)]
        second = [[o * inner + i for i in range(inner)] for o in range(outer)]
        if _fits(rows, first) and _fits(rows, second):
            return (tuple(map(tuple, first)), tuple(map(tuple, second)))
    return ()


def staged_psum_scatter(x: jax.Array, axis_name: AxisName, dim: int, stages: Stages) -> jax.Array:
    """``lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)`` run in
    ``stages`` (`Stages`; ``()``: one reduce-scatter). Each device ends with the slice the
    one tiled reduce-scatter hands it.

    A stage over pairs of devices (``(a, a + k)``, as `scatter_stages` builds over a line of
    two chips) runs as one exchange: each device sends the half its partner keeps and adds
    the half it receives, the same two-operand sum. XLA:TPU runs a reduce-scatter over two
    chips synchronously (for a 1024 x 3072 gradient as a fusion that all-reduces the whole
    padded buffer, 139 us on v5p in its schedule), and the exchange as an asynchronous
    collective-permute of half of it beside compute, for two elementwise passes over that
    half.

    Args:
      x: this device's operand.
      axis_name: the mesh axis or axes summed over (indexed row-major, as ``psum_scatter``).
      dim: the dimension scattered.
      stages: per stage, the ``axis_index_groups`` (`scatter_stages`).

    Returns:
      This device's slice of the sum.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
        >>> stages = (((0, 2), (1, 3)), ((0, 1), (2, 3)))
        >>> f = jax.shard_map(lambda x: staged_psum_scatter(x, "data", 0, stages),
        ...                   mesh=mesh, in_specs=P(), out_specs=P("data"))
        >>> f(jnp.arange(4.0)).tolist()  # the sum of four copies, device d keeps slice d
        [0.0, 4.0, 8.0, 12.0]
    """
    name = axis_name if isinstance(axis_name, str) or len(axis_name) != 1 else axis_name[0]
    if not stages:
        return lax.psum_scatter(x, name, scatter_dimension=dim, tiled=True)
    for groups in stages:
        stride = _pair_stride(groups) if x.shape[dim] % 2 == 0 else None
        if stride is not None:
            x = _exchange_halves(x, name, dim, groups, stride)
        else:
            x = lax.psum_scatter(
                x, name, scatter_dimension=dim, tiled=True, axis_index_groups=[list(g) for g in groups]
            )
    return x


def _pair_stride(groups: tuple[tuple[int, ...], ...]) -> int | None:
    """``k`` where every group is a pair ``(a, a + k)`` and a device's place in its pair is
    ``index // k % 2`` (the first stage `scatter_stages` builds), else None."""
    if not groups or any(len(g) != 2 for g in groups):
        return None
    stride = groups[0][1] - groups[0][0]
    if stride <= 0 or any(b - a != stride for a, b in groups):
        return None
    place = np.full(2 * len(groups), -1)
    for a, b in groups:
        if not (0 <= a < place.size and 0 <= b < place.size):
            return None
        place[a], place[b] = 0, 1
    return stride if np.array_equal(place, np.arange(place.size) // stride % 2) else None


def _exchange_halves(
    x: jax.Array, axis_name: AxisName, dim: int, pairs: tuple[tuple[int, ...], ...], stride: int
) -> jax.Array:
    """A reduce-scatter over pairs of devices as one exchange of halves."""
    place = lax.axis_index(axis_name) // stride % 2
    half = x.shape[dim] // 2
    keep = lax.dynamic_slice_in_dim(x, place * half, half, dim)
    send = lax.dynamic_slice_in_dim(x, (1 - place) * half, half, dim)
    swaps = [(a, b) for a, b in pairs] + [(b, a) for a, b in pairs]
    return keep + lax.ppermute(send, axis_name, swaps)
