"""Flat, padded bucket layout: leaves <-> bucket shards.

Every tensor that travels sharded is flattened, zero-padded to a multiple of the axis
size ``P`` and cut into ``P`` equal chunks; device ``d`` owns chunk ``d``. A flat chunk
is the same for any reshape of the tensor (row-major order is kept), which is what lets
the update run elementwise on shards. A bucket interleaves its leaves' chunks so that
one tiled reduce-scatter hands each device the chunk of every leaf at a static offset::

    bucket buffer = [dev0: leaf0[c0] leaf1[c0] ... | dev1: leaf0[c1] leaf1[c1] ... | ...]

Example:
    >>> import numpy as np
    >>> layout = BucketLayout.of([(2, 3), (5,)], ["float32", "float32"], axis_size=4)
    >>> layout.chunk_sizes, layout.shard_size
    ((2, 2), 4)
"""

from __future__ import annotations

from jaxsched._errors import JaxschedValueError
from jaxsched.core._axes import AxisName

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["BucketLayout", "chunk_size", "gather_chunk", "host_chunks", "local_chunk", "pad_flat", "valid_mask"]


def chunk_size(shape: Sequence[int], axis_size: int) -> int:
    """Elements per device for a tensor of ``shape`` sharded flat over ``axis_size`` devices."""
    return max(1, math.ceil(math.prod(shape) / axis_size))


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where each leaf of one bucket lives inside the bucket's per-device shard.

    Attributes:
      shapes: full (unsharded) shape of every leaf, in bucket order.
      dtype: the one dtype of every leaf in the bucket (buckets never mix dtypes).
      axis_size: number of devices ``P`` along the mesh axis.
      chunk_sizes: elements of each leaf per device, ``ceil(size / P)``.
      offsets: start of each leaf's chunk inside the device shard.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype
    axis_size: int
    chunk_sizes: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], dtypes: Sequence, axis_size: int) -> "BucketLayout":
        distinct = {np.dtype(d) for d in dtypes}
        if len(distinct) != 1:
            raise JaxschedValueError(f"a bucket must hold one dtype, got {sorted(map(str, distinct))}")
        exact = tuple(tuple(int(d) for d in s) for s in shapes)
        chunks = tuple(chunk_size(s, axis_size) for s in exact)
        offsets = tuple(int(o) for o in np.cumsum((0,) + chunks[:-1]))
        return cls(exact, distinct.pop(), axis_size, chunks, offsets)

    @property
    def shard_size(self) -> int:
        """Elements of the bucket held by one device."""
        return sum(self.chunk_sizes)

    @property
    def nbytes(self) -> int:
        """Bytes of the unpadded bucket (what an all-reduce of it would move)."""
        return sum(math.prod(s) for s in self.shapes) * self.dtype.itemsize

    # -- whole leaves <-> the (P * shard_size,) bucket buffer -------------------------------
    def pack(self, leaves: Sequence[jax.Array]) -> jax.Array:
        """Full leaves -> the interleaved bucket buffer of ``P * shard_size`` elements."""
        columns = [
            pad_flat(leaf, c * self.axis_size).reshape(self.axis_size, c) for leaf, c in zip(leaves, self.chunk_sizes)
        ]
        return jnp.concatenate(columns, axis=1).reshape(-1)

    def unpack(self, buffer: jax.Array) -> list[jax.Array]:
        """The bucket buffer -> full leaves with their original shapes (padding dropped)."""
        table = buffer.reshape(self.axis_size, self.shard_size)
        leaves = []
        for shape, c, o in zip(self.shapes, self.chunk_sizes, self.offsets):
            flat = table[:, o : o + c].reshape(-1)[: math.prod(shape)]
            leaves.append(flat.reshape(shape))
        return leaves

    # -- one device's shard <-> per-leaf chunks ---------------------------------------------
    def split_shard(self, shard: jax.Array) -> list[jax.Array]:
        """This device's bucket shard -> each leaf's flat chunk."""
        return [shard[o : o + c] for c, o in zip(self.chunk_sizes, self.offsets)]

    def join_chunks(self, chunks: Sequence[jax.Array]) -> jax.Array:
        return jnp.concatenate([c.reshape(-1).astype(self.dtype) for c in chunks])


def pad_flat(leaf: jax.Array, length: int) -> jax.Array:
    """``leaf`` flattened and zero-padded to ``length`` elements."""
    flat = jnp.ravel(leaf)
    return jnp.pad(flat, (0, length - flat.shape[0])) if length > flat.shape[0] else flat


def local_chunk(full: jax.Array, axis_name: AxisName, axis_size: int) -> jax.Array:
    """This device's chunk of a replicated tensor; no communication."""
    c = chunk_size(full.shape, axis_size)
    padded = pad_flat(full, c * axis_size)
    return lax.dynamic_slice_in_dim(padded, lax.axis_index(axis_name) * c, c)


def gather_chunk(chunk: jax.Array, shape: Sequence[int], axis_name: AxisName) -> jax.Array:
    """All devices' chunks -> the full tensor of ``shape`` (one all-gather)."""
    flat = lax.all_gather(chunk, axis_name, tiled=True)
    return flat[: math.prod(shape)].reshape(shape)


def valid_mask(shape: Sequence[int], axis_name: AxisName, axis_size: int) -> jax.Array:
    """True where this device's chunk holds real elements rather than padding."""
    c = chunk_size(shape, axis_size)
    index = lax.axis_index(axis_name) * c + jnp.arange(c)
    return index < math.prod(shape)


def host_chunks(full: np.ndarray, axis_size: int) -> np.ndarray:
    """A tensor as the ``(P * chunk,)`` global array that the sharded state stores."""
    c = chunk_size(full.shape, axis_size)
    flat = np.ravel(np.asarray(full))
    return np.pad(flat, (0, c * axis_size - flat.size))
