"""``Hierarchical``: a sum over two levels of the network, with fewer bytes on the slow one.

Data parallelism over several mesh axes (``("dcn", "ici")`` on a multi-slice TPU pod,
``("hosts", "local")`` on a multi-node GPU job) reduces gradients over their product. A
flat all-reduce moves the whole buffer across the slow links. The hierarchical one
(Goyal et al. 2017; MultiTree, Huang et al. 2021) moves ``1/F`` of it, ``F`` the devices
on the fast axis:

1. reduce-scatter over the fast axis: each device holds the fast group's sum of ``1/F``;
2. all-reduce of that shard over the slow axis (optionally through ``slow_collective``, e.g.
   a compressor, so that only the slow links are lossy);
3. all-gather over the fast axis.

A reduce-scatter (``dear``) runs steps 1 and a slow reduce-scatter, and hands every device
the same slice a flat tiled ``psum_scatter`` over the data axis would; an all-gather is
the inverse. The sums are the same as the flat collective's, up to float rounding from
the order of addition.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 2), ("dcn", "ici"), devices=jax.devices()[:4])
    >>> spec = BucketSpec(0, 3, jnp.dtype("float32"), 4, mesh_axes=(("dcn", 2), ("ici", 2)))
    >>> hier = Hierarchical(fast="ici", slow="dcn")
    >>> (state,) = hier.init([spec])
    >>> def body(x):
    ...     return hier.all_reduce(x, ("dcn", "ici"), spec, state)[0]
    >>> f = jax.shard_map(body, mesh=mesh, in_specs=P(("dcn", "ici")), out_specs=P(), check_vma=False)
    >>> x = jax.device_put(jnp.arange(12.0), jax.NamedSharding(mesh, P(("dcn", "ici"))))
    >>> f(x).tolist()    # [0+3+6+9, 1+4+7+10, 2+5+8+11]
    [18.0, 22.0, 26.0]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from jaxsched._errors import JaxschedTypeError, JaxschedValueError
from jaxsched.core._axes import AxisName, as_axes
from jaxsched.runtime.collectives._base import BucketSpec, Collective, CollectiveState

__all__ = ["Hierarchical", "default_collective_for", "hierarchy_from_mesh", "slow_axes"]


class Hierarchical(Collective):
    """Reduce-scatter over ``fast``, reduce over ``slow``, all-gather over ``fast``.

    Args:
      fast: the mesh axis (or tuple of axes) whose links are fast: ICI, NVLink, one host.
      slow: the mesh axis (or tuple) whose links are slow: DCN, InfiniBand, Ethernet.
        ``fast`` and ``slow`` together must be the step's data-parallel axes (the axes its
        batch is sharded over).
      slow_collective: how the fast-reduced shards cross ``slow``; default the plain
        collective. A compressor here (``TopK(0.01)``) compresses only the slow links: its
        state (residuals, ``bytes_sent``) is carried per bucket and counts slow traffic.

    Example:
        Pass it as ``jaxsched.schedule(step, collective=Hierarchical(fast="ici", slow="dcn"))``;
        the module docstring runs one all-reduce. Its slow collective sees each bucket's
        shard of the fast group:

        >>> import jax.numpy as jnp
        >>> hier = Hierarchical(fast="ici", slow="dcn")
        >>> spec = BucketSpec(0, 10, jnp.dtype("float32"), 8, mesh_axes=(("dcn", 2), ("ici", 4)))
        >>> shard = hier.slow_bucket(spec)
        >>> hier, shard.size, shard.axis_size
        (Hierarchical(fast='ici', slow='dcn'), 3, 2)
    """

    def __init__(
        self,
        fast: str | Sequence[str] = "ici",
        slow: str | Sequence[str] = "dcn",
        slow_collective: Collective | None = None,
    ):
        super().__init__()
        self.fast, self.slow = as_axes(fast), as_axes(slow)
        for name, axes in (("fast", self.fast), ("slow", self.slow)):
            if not axes or not all(isinstance(a, str) and a for a in axes):
                raise JaxschedTypeError(f"Hierarchical({name}={axes!r}): give a mesh axis name or a tuple of names")
        if set(self.fast) & set(self.slow):
            raise JaxschedValueError(
                f"Hierarchical: axes {sorted(set(self.fast) & set(self.slow))} are "
                "both fast and slow; each data-parallel axis is one or the other"
            )
        if slow_collective is not None and not isinstance(slow_collective, Collective):
            raise JaxschedTypeError(
                f"Hierarchical(slow_collective=...) must be a jaxsched Collective "
                f"(e.g. jaxsched.runtime.compress.TopK(0.01)), got {type(slow_collective).__name__}"
            )
        self.slow_collective = slow_collective if slow_collective is not None else Collective()
        self.exact = self.slow_collective.exact

    def __repr__(self) -> str:
        fast = self.fast[0] if len(self.fast) == 1 else self.fast
        slow = self.slow[0] if len(self.slow) == 1 else self.slow
        inner = "" if type(self.slow_collective) is Collective else f", slow_collective={self.slow_collective!r}"
        return f"Hierarchical(fast={fast!r}, slow={slow!r}{inner})"

    # -- the two levels -------------------------------------------------------------------
    def _sizes(self, bucket: BucketSpec) -> tuple[int, int]:
        """Devices along the fast and the slow axes the bucket crosses. A bucket may cross
        some of them only: an HSDP parameter block, reduce-scattered over the fast axes in
        backward already, is summed over the slow ones alone."""
        sizes = dict(bucket.mesh_axes)
        if not sizes or not set(sizes) <= set(self.fast + self.slow):
            data = tuple(sizes) or "one axis (unknown here)"
            raise JaxschedValueError(
                f"{self!r} needs a step whose data-parallel axes are exactly "
                f"{self.slow + self.fast} (its batch sharded over them); this step's are {data}"
            )
        return math.prod(sizes.get(a, 1) for a in self.fast), math.prod(sizes.get(a, 1) for a in self.slow)

    def _present(self, axes: tuple, bucket: BucketSpec) -> tuple:
        sizes = dict(bucket.mesh_axes)
        return tuple(a for a in axes if a in sizes)

    def _axis(self, axes: tuple[str, ...]) -> AxisName:
        return axes[0] if len(axes) == 1 else axes

    def slow_bucket(self, bucket: BucketSpec) -> BucketSpec:
        """What ``slow_collective`` is told of a bucket: the fast group's shard of it.

        Args:
          bucket: the bucket as the strategy describes it.

        Returns:
          The `BucketSpec` of the fast group's shard, over the slow axes only.

        Example:
            >>> import jax.numpy as jnp
            >>> spec = BucketSpec(0, 8, jnp.dtype("float32"), 4, mesh_axes=(("dcn", 2), ("ici", 2)))
            >>> Hierarchical(fast="ici", slow="dcn").slow_bucket(spec).mesh_axes
            (('dcn', 2),)
        """
        fast, slow = self._sizes(bucket)
        shard = -(-bucket.size // fast)  # all-reduce buffers are padded to a multiple of fast
        sizes = dict(bucket.mesh_axes)
        return dataclasses.replace(
            bucket,
            size=shard,
            axis_size=slow,
            shapes=((shard,),),
            form="packed",
            mesh_axes=tuple((a, sizes[a]) for a in self.slow if a in sizes),
            scatter_stages=(),  # the bucket's stages index the whole data axis, not the slow one
        )

    def init(self, buckets: Sequence[BucketSpec]) -> tuple:
        return tuple(self.slow_collective.init([self.slow_bucket(b) for b in buckets]))

    def _check_axis(self, axis_name: AxisName) -> None:
        if not set(as_axes(axis_name)) <= set(self.fast + self.slow):
            raise JaxschedValueError(
                f"{self!r} was asked to reduce over {axis_name!r}; it reduces over "
                f"the data-parallel axes {self.slow + self.fast}"
            )

    def all_reduce(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        self._check_axis(axis_name)
        fast, _ = self._sizes(bucket)
        fast_axes, slow_axes_ = self._present(self.fast, bucket), self._present(self.slow, bucket)
        if not fast_axes:  # over the slow axes only (an HSDP block): the slow level alone
            return self.slow_collective.all_reduce(buffer, self._axis(slow_axes_), self.slow_bucket(bucket), state)
        if not slow_axes_:
            return lax.psum(buffer, self._axis(fast_axes)), state
        n = buffer.shape[0]
        padded = jnp.pad(buffer, (0, -n % fast))
        shard = lax.psum_scatter(padded, self._axis(self.fast), scatter_dimension=0, tiled=True)
        shard, state = self.slow_collective.all_reduce(shard, self._axis(self.slow), self.slow_bucket(bucket), state)
        full = lax.all_gather(shard, self._axis(self.fast), tiled=True)
        return full[:n], state

    def _grid(self, axis_name: AxisName, bucket: BucketSpec) -> tuple[list[int], list[int], list[int]]:
        """Sizes of the data axes in ``axis_name``'s order, and the positions of the fast and
        of the slow ones among them."""
        order = list(as_axes(axis_name))
        sizes = dict(bucket.mesh_axes)
        return ([sizes[a] for a in order], [order.index(a) for a in self.fast], [order.index(a) for a in self.slow])

    def reduce_scatter(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        """The slice a tiled ``psum_scatter`` over ``axis_name`` gives this device.

        Args:
          buffer: this device's full flat buffer.
          axis_name: the data axes (``fast`` and ``slow`` together).
          bucket: the bucket (its ``mesh_axes`` give the grid).
          state: this bucket's entry of `init`.

        Returns:
          ``(shard, new_state)``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime.collectives import BucketSpec, Hierarchical
          >>> mesh = jax.make_mesh((2, 2), ("dcn", "ici"), devices=jax.devices()[:4])
          >>> spec = BucketSpec(0, 4, jnp.dtype("float32"), 4, mesh_axes=(("dcn", 2), ("ici", 2)))
          >>> hier = Hierarchical(fast="ici", slow="dcn")
          >>> (state,) = hier.init([spec])
          >>> f = jax.shard_map(lambda b: hier.reduce_scatter(b, ("dcn", "ici"), spec, state)[0], mesh=mesh,
          ...                   in_specs=P(("dcn", "ici")), out_specs=P(("dcn", "ici")), check_vma=False)
          >>> x = jax.device_put(jnp.arange(16.0), jax.NamedSharding(mesh, P(("dcn", "ici"))))
          >>> f(x).tolist()  # as a flat psum_scatter: device k holds entry k of the sum
          [24.0, 28.0, 32.0, 36.0]
        """
        self._check_axis(axis_name)
        if not self._present(self.fast, bucket):  # over the slow axes only (an HSDP block)
            return self.slow_collective.reduce_scatter(buffer, axis_name, self.slow_bucket(bucket), state)
        dims, fast_pos, slow_pos = self._grid(axis_name, bucket)
        chunk = buffer.shape[0] // math.prod(dims)
        # slices are numbered row-major over axis_name; put the fast axes first so that the
        # fast scatter hands each device every slow slice of its own fast position
        grid = buffer.reshape(tuple(dims) + (chunk,))
        grid = jnp.transpose(grid, fast_pos + slow_pos + [len(dims)]).reshape(-1)
        shard = lax.psum_scatter(grid, self._axis(self.fast), scatter_dimension=0, tiled=True)
        return self.slow_collective.reduce_scatter(shard, self._axis(self.slow), self.slow_bucket(bucket), state)

    def all_gather(
        self, shard: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        """Every device's slice in ``axis_name``'s order, as a tiled ``all_gather`` over it.

        Args:
          shard: this device's slice.
          axis_name: the data axes (``fast`` and ``slow`` together).
          bucket: the bucket (its ``mesh_axes`` give the grid).
          state: this bucket's entry of `init`.

        Returns:
          ``(buffer, new_state)``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime.collectives import BucketSpec, Hierarchical
          >>> mesh = jax.make_mesh((2, 2), ("dcn", "ici"), devices=jax.devices()[:4])
          >>> spec = BucketSpec(0, 4, jnp.dtype("float32"), 4, mesh_axes=(("dcn", 2), ("ici", 2)))
          >>> hier = Hierarchical(fast="ici", slow="dcn")
          >>> (state,) = hier.init([spec])
          >>> f = jax.shard_map(lambda s: hier.all_gather(s, ("dcn", "ici"), spec, state)[0], mesh=mesh,
          ...                   in_specs=P(("dcn", "ici")), out_specs=P(), check_vma=False)
          >>> x = jax.device_put(jnp.arange(4.0), jax.NamedSharding(mesh, P(("dcn", "ici"))))
          >>> f(x).tolist()  # as a flat tiled all_gather
          [0.0, 1.0, 2.0, 3.0]
        """
        self._check_axis(axis_name)
        if not self._present(self.fast, bucket):  # over the slow axes only (an HSDP block)
            return self.slow_collective.all_gather(shard, axis_name, self.slow_bucket(bucket), state)
        dims, fast_pos, slow_pos = self._grid(axis_name, bucket)
        chunk = shard.shape[0]
        group = lax.all_gather(shard, self._axis(self.slow), tiled=True)
        grid = lax.all_gather(group, self._axis(self.fast), tiled=True)
        perm = fast_pos + slow_pos
        grid = grid.reshape(tuple(dims[p] for p in perm) + (chunk,))
        inverse = [perm.index(k) for k in range(len(dims))] + [len(dims)]
        return jnp.transpose(grid, inverse).reshape(-1), state


def slow_axes(mesh: Mesh, axes: AxisName) -> tuple[str, ...]:
    """The axes among ``axes`` whose links the mesh itself says are slow.

    On a TPU pod of several slices, those along which devices change ``slice_index``
    (DCN; hosts within a slice share ICI). Elsewhere, those along which devices change
    process (the network between hosts; GPUs of one host share NVLink).

    Args:
      mesh: the step's mesh.
      axes: the data axis or axes.

    Returns:
      The slow axes, in ``axes``' order (empty on one host of one slice).

    Example:
        >>> import jax
        >>> slow_axes(jax.make_mesh((2, 4), ("slow", "fast")), ("slow", "fast"))  # one process
        ()
    """
    devices = mesh.devices
    slices = np.vectorize(lambda d: getattr(d, "slice_index", 0) or 0, otypes=[np.int64])(devices)
    level = (
        slices if np.unique(slices).size > 1 else np.vectorize(lambda d: d.process_index, otypes=[np.int64])(devices)
    )
    names = list(mesh.axis_names)
    return tuple(a for a in as_axes(axes) if np.any(level != np.take(level, [0], axis=names.index(a))))


def hierarchy_from_mesh(mesh: Mesh, axes: AxisName) -> Hierarchical | None:
    """``Hierarchical(fast=..., slow=...)`` for a data axis that spans slow and fast mesh
    axes (`slow_axes`); None when the mesh names no slow axis, or only slow ones.

    Args:
      mesh: the step's mesh.
      axes: the data axis or axes.

    Returns:
      A `Hierarchical`, or None.

    Example:
        >>> import jax
        >>> print(hierarchy_from_mesh(jax.make_mesh((2, 4), ("slow", "fast")), ("slow", "fast")))
        None
    """
    axes = as_axes(axes)
    if len(axes) < 2:
        return None
    slow = slow_axes(mesh, axes)
    fast = tuple(a for a in axes if a not in slow)
    if not slow or not fast:
        return None
    return Hierarchical(fast=fast, slow=slow)


def default_collective_for(mesh: Mesh, axes: AxisName) -> Hierarchical | None:
    """The collective jaxsched uses when the user chose none: `hierarchy_from_mesh`,
    except on TPU. XLA:TPU already lowers a flat sum over slices in two levels (an ICI
    all-reduce, then ``1/F`` of it over DCN as send/recv), and estimates the explicit
    hierarchy slower (``benchmarks/hierarchical.py``), so the flat sum is left to it.

    Args:
      mesh: the step's mesh.
      axes: the data axis or axes.

    Returns:
      A `Hierarchical`, or None (the plain collective).

    Example:
        >>> import jax
        >>> print(default_collective_for(jax.make_mesh((8,), ("data",)), "data"))
        None
    """
    if mesh.devices.flat[0].platform == "tpu":
        return None
    return hierarchy_from_mesh(mesh, axes)
