"""How one device holds a value of the global program: replicated, a block, or a partial sum.

A ``jax.jit`` step computes on global arrays; the per-device program computes on what one
device holds of each of them. These forms are enough for data parallelism and for
parameters sharded over the data axes (FSDP, HSDP):

* `REPLICATED`: the whole value, the same on every device;
* ``sharded(d)``: this device's block of dimension ``d`` (block ``i`` of ``P`` equal ones
  for device ``i`` along the data axes), as ``NamedSharding`` lays out a sharded batch;
* ``block(d, axes)``: a *parameter block*: dimension ``d`` split over the mesh axes ``axes``
  (all the data axes, as FSDP shards a weight, or some of them, as HSDP does), as the user
  placed a parameter or optimizer-state leaf. Rules that do not know blocks see it gathered
  (FSDP's all-gather before use); elementwise and reducing rules, which the optimizer runs,
  keep it a block;
* `PARTIAL`: a term of a sum over devices: the global value is the ``psum`` of every
  device's local value. A contraction over the sharded dimension leaves this, and it
  stays unreduced through linear operations, so each gradient is reduced once, where it
  is complete: the gradient reductions every strategy schedules. ``partial_over(axes)`` is
  a sum over some data axes only (a sum over a parameter block's dimension), the same on
  the others.

`AxisContext` converts between the forms; every conversion is exact. A partial sum
becomes a block by a reduce-scatter, never by a sum and a slice; on a TPU torus where one
reduce-scatter would span a 3-D block of chips (which XLA:TPU decomposes into an all-reduce
of the whole value), by two, over a line and a plane of chips (`jaxsched.core._torus`).

Example:
    >>> sharded(0), REPLICATED, PARTIAL, block(1, ("fsdp",)), partial_over(("fsdp",))
    (S(0), R, Pt, B(1:fsdp), Pt(fsdp))
    >>> join(REPLICATED, sharded(1)), join(sharded(0), sharded(1)), join(REPLICATED, PARTIAL)
    (S(1), R, Pt)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from jaxsched._errors import JaxschedRuntimeError
from jaxsched.core._torus import block_scatter_stages, staged_psum_scatter
from jaxsched.core._axes import AxisName, as_axes

__all__ = [
    "AxisContext",
    "Kind",
    "PARTIAL",
    "REPLICATED",
    "block",
    "join",
    "local_shape",
    "partial_over",
    "sharded",
]


@dataclasses.dataclass(frozen=True)
class Kind:
    """What one device holds of a global value.

    Attributes:
      dim: the dimension split in blocks (None: not split).
      partial: whether the device holds a term of a sum over devices.
      over: the mesh axes of a parameter block (``dim`` set) or of a partial sum over some of
        the data axes only; None for the batch's blocks and sums, which span every data axis.
    """

    dim: int | None = None
    partial: bool = False
    over: tuple[str, ...] | None = None

    def __repr__(self) -> str:
        if self.partial:
            return "Pt" if self.over is None else f"Pt({','.join(self.over)})"
        if self.dim is None:
            return "R"
        return f"S({self.dim})" if self.over is None else f"B({self.dim}:{','.join(self.over)})"

    @property
    def is_replicated(self) -> bool:
        return self.dim is None and not self.partial

    @property
    def is_block(self) -> bool:
        """A parameter block: split along ``dim`` over the axes ``over``."""
        return self.dim is not None and self.over is not None

    @property
    def is_partial_over_some(self) -> bool:
        """A sum over some of the data axes (not all): a parameter block's reduction."""
        return self.partial and self.over is not None

    @property
    def is_special(self) -> bool:
        """A kind that only block-aware rules take (other rules get it converted first)."""
        return self.over is not None

    @property
    def split(self) -> int:
        """``dim`` of a kind known to be split (``sharded``, a block): an ``int`` for the type
        checker; reading it of a kind that is not split is a bug."""
        if self.dim is None:
            raise JaxschedRuntimeError(f"{self!r} is not split along a dimension")
        return self.dim

    def moved(self, dim: int) -> "Kind":
        """The same kind along another dimension (a transpose, a squeeze, a loop's slice)."""
        return dataclasses.replace(self, dim=int(dim))


REPLICATED = Kind()
PARTIAL = Kind(partial=True)


def sharded(dim: int) -> Kind:
    """The kind of a value whose dimension ``dim`` is split in blocks over the data axes."""
    return Kind(dim=int(dim))


def block(dim: int, axes: Any) -> Kind:
    """A parameter block: dimension ``dim`` split over the mesh axes ``axes``, in that order."""
    return Kind(dim=int(dim), over=tuple(as_axes(axes)))


def partial_over(axes: Any) -> Kind:
    """A term of a sum over the mesh axes ``axes`` (some of the data axes)."""
    return Kind(partial=True, over=tuple(as_axes(axes)))


def join(a: Kind, b: Kind) -> Kind:
    """The kind both ``a`` and ``b`` convert to without communication where possible (a loop
    carry that enters as one and leaves as the other)."""
    if a == b:
        return a
    if a.is_replicated:
        return b
    if b.is_replicated:
        return a
    if a.is_block and b.partial:
        return a  # a partial sum becomes the block by a reduce-scatter
    if b.is_block and a.partial:
        return b
    return REPLICATED  # two different blocks, or a block and a partial sum: gather/reduce


def local_shape(shape: Sequence[int], kind: Kind, axis_size: int) -> tuple[int, ...]:
    """The shape one device holds of a global ``shape`` of ``kind`` (``axis_size``: the
    devices its dimension is split over)."""
    shape = tuple(shape)
    if kind.dim is None:
        return shape
    return shape[: kind.dim] + (shape[kind.dim] // axis_size,) + shape[kind.dim + 1 :]


@dataclasses.dataclass(frozen=True)
class AxisContext:
    """The data axes of the per-device program and the exact conversions between kinds.

    Attributes:
      axis_name: one mesh axis or a tuple of them (the batch's ``PartitionSpec`` entry).
      axis_size: devices along it, ``P``.
      axis_sizes: ``(name, size)`` of every data axis (for blocks over some of them).
      model_axes: the mesh axes XLA partitions inside the per-device program (tensor or
        expert parallel, above size one); empty when the program is manual over every axis.
      split_inside: the step splits its batch itself, with a sharding constraint over the data
        axes: such a constraint on a whole value makes it this device's block there.
      mesh: the step's mesh, whose devices tell whether a reduce-scatter runs in two stages
        (`scatter`); None: always one.
    """

    axis_name: AxisName
    axis_size: int
    axis_sizes: tuple[tuple[str, int], ...] = ()
    model_axes: tuple[str, ...] = ()
    split_inside: bool = False
    mesh: Mesh | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        return as_axes(self.axis_name)

    def size_of(self, axes: Any) -> int:
        """Devices along ``axes`` (some of the data axes); ``None``: all of them."""
        if axes is None:
            return self.axis_size
        sizes = dict(self.axis_sizes)
        return math.prod(sizes[a] for a in as_axes(axes))

    def split_size(self, kind: Kind) -> int:
        """How many blocks ``kind``'s dimension is split into."""
        return self.size_of(kind.over)

    def normalized(self, kind: Kind) -> Kind:
        """A partial sum over every data axis is `PARTIAL`, whatever order names them."""
        if kind.partial and kind.over is not None and set(kind.over) == set(self.axes):
            return PARTIAL
        return kind

    def index(self, axes: Any = None) -> Any:
        """This device's position along the data axes, or along ``axes`` (the block it holds)."""
        return lax.axis_index(self.axis_name if axes is None else tuple(axes))

    def can_shard(self, shape: Sequence[int], dim: int) -> bool:
        """Whether dimension ``dim`` of ``shape`` splits into ``P`` equal blocks."""
        return 0 <= dim < len(shape) and shape[dim] % self.axis_size == 0 and shape[dim] > 0

    def convert(self, value: Any, have: Kind, want: Kind, shape: Sequence[int], nested: bool = False) -> Any:
        """``value`` (a local value of global ``shape`` held as ``have``) held as ``want``
        (``nested``: inside a loop, branch or checkpoint of the per-device body, `scatter`)."""
        have, want = self.normalized(have), self.normalized(want)
        if have == want:
            return value
        if self.axis_size == 1 and not (have.partial and want.is_replicated):
            return value  # one device: every kind is the whole value (a psum stays: it marks
            # the gradient reductions the strategies schedule, and costs nothing)
        if want.is_replicated:
            return self.replicate(value, have)
        if want.partial:
            return self.to_partial(self.replicate(value, have), want.over)
        if have.partial:
            return self.scatter(value, have, want, shape, nested)
        if have.dim is not None and have.dim == want.dim and self._axes_of(have) == self._axes_of(want):
            return value  # a parameter block over the data axes is laid out as the batch's
        if have.dim is not None and have.over is None and want.over is None:  # blocks of another dimension
            return lax.all_to_all(value, self.axis_name, split_axis=want.dim, concat_axis=have.dim, tiled=True)
        return self.block(self.replicate(value, have), want.split, shape, want.over)

    def _axes_of(self, kind: Kind) -> tuple[str, ...]:
        return self.axes if kind.over is None else tuple(kind.over)

    def replicate(self, value: Any, have: Kind) -> Any:
        if have.partial:
            return lax.psum(value, self.axis_name if have.over is None else have.over)
        if have.dim is not None:
            axes = self.axis_name if have.over is None else have.over
            return lax.all_gather(value, axes, axis=have.dim, tiled=True)
        return value

    def scatter(self, value: Any, have: Kind, want: Kind, shape: Sequence[int], nested: bool = False) -> Any:
        """A partial sum as a block (of the batch's kind or a parameter's): a reduce-scatter
        over the block's axes where the sum spans them, then a sum over the sum's other axes.

        ``nested`` (inside a loop, branch or checkpoint, a scanned layer's gradient, which no
        strategy reschedules): the reduce-scatter runs in the stages
        `jaxsched.core._torus.block_scatter_stages` gives where one over the block's axes
        would span a 3-D block of TPU chips (a stage over pairs of chips as an exchange of
        halves, `jaxsched.core._torus.staged_psum_scatter`), as the strategies'
        ``scatter_block`` sends a top-level block's gradient: each device ends with the same block. At the top level
        it stays one, the gradient reduction the strategies find and schedule."""
        summed = self._axes_of(have)
        axes = self._axes_of(want)
        if not set(axes) <= set(summed):
            return self.block(self.replicate(value, have), want.split, shape, want.over)
        name = axes if len(axes) > 1 else axes[0]
        size = math.prod(np.shape(value)) * jnp.dtype(jnp.result_type(value)).itemsize
        stages = block_scatter_stages(self.mesh, axes, size) if nested else ()
        part = staged_psum_scatter(value, name, want.split, stages)
        rest = tuple(a for a in summed if a not in axes)
        return lax.psum(part, rest) if rest else part

    def block(self, value: Any, dim: int, shape: Sequence[int], axes: Any = None) -> Any:
        """This device's block of dimension ``dim`` of a replicated value: a slice, no traffic
        (``axes``: a parameter block's mesh axes; None: the data axes)."""
        size = shape[dim] // self.size_of(axes)
        return lax.dynamic_slice_in_dim(value, self.index(axes) * size, size, axis=dim)

    def to_partial(self, value: Any, axes: Any = None) -> Any:
        """A replicated value as a term of a sum over devices (over ``axes``, or every data
        axis): the first device holds it, the others zero (exact, unlike dividing by ``P``)."""
        value = jnp.asarray(value)
        return jnp.where(self.index(axes) == 0, value, jnp.zeros_like(value))
