"""How one device holds a value of the global program: replicated, a block, or a partial sum.

A ``jax.jit`` step computes on global arrays; the per-device program computes on what one
device holds of each of them. Three forms are enough for data parallelism (the batch
sharded over the data axes, everything else replicated):

* :data:`REPLICATED`: the whole value, the same on every device;
* ``sharded(d)``: this device's block of dimension ``d`` (block ``i`` of ``P`` equal ones
  for device ``i`` along the data axes), as ``NamedSharding`` lays out a sharded batch;
* :data:`PARTIAL`: a term of a sum over devices: the global value is the ``psum`` of every
  device's local value. A contraction over the sharded dimension leaves this, and it
  stays unreduced through linear operations, so each gradient is reduced once, where it
  is complete: the gradient reductions every strategy schedules.

:class:`AxisContext` converts between the forms; every conversion is exact.

Example:
    >>> sharded(0), REPLICATED, PARTIAL
    (S(0), R, Pt)
    >>> join(REPLICATED, sharded(1)), join(sharded(0), sharded(1)), join(REPLICATED, PARTIAL)
    (S(1), R, Pt)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
from jax import lax

from jaxsched.core.axes import AxisName, as_axes

__all__ = ["AxisContext", "Kind", "PARTIAL", "REPLICATED", "join", "local_shape", "sharded"]


@dataclasses.dataclass(frozen=True)
class Kind:
    """What one device holds of a global value.

    Attributes:
      dim: the dimension sharded over the data axes (None: not sharded).
      partial: whether the device holds a term of a sum over devices.
    """

    dim: int | None = None
    partial: bool = False

    def __repr__(self) -> str:
        return "Pt" if self.partial else ("R" if self.dim is None else f"S({self.dim})")

    @property
    def is_replicated(self) -> bool:
        return self.dim is None and not self.partial


REPLICATED = Kind()
PARTIAL = Kind(partial=True)


def sharded(dim: int) -> Kind:
    """The kind of a value whose dimension ``dim`` is split in blocks over the data axes."""
    return Kind(dim=int(dim))


def join(a: Kind, b: Kind) -> Kind:
    """The kind both ``a`` and ``b`` convert to without communication where possible (a loop
    carry that enters as one and leaves as the other)."""
    if a == b:
        return a
    if a.is_replicated:
        return b
    if b.is_replicated:
        return a
    return REPLICATED  # two different blocks, or a block and a partial sum: gather/reduce


def local_shape(shape: Sequence[int], kind: Kind, axis_size: int) -> tuple[int, ...]:
    """The shape one device holds of a global ``shape`` of ``kind``."""
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
    """

    axis_name: AxisName
    axis_size: int

    @property
    def axes(self) -> tuple[str, ...]:
        return as_axes(self.axis_name)

    def index(self) -> Any:
        """This device's position along the data axes (the block it holds)."""
        return lax.axis_index(self.axis_name)

    def can_shard(self, shape: Sequence[int], dim: int) -> bool:
        """Whether dimension ``dim`` of ``shape`` splits into ``P`` equal blocks."""
        return 0 <= dim < len(shape) and shape[dim] % self.axis_size == 0 and shape[dim] > 0

    def convert(self, value: Any, have: Kind, want: Kind, shape: Sequence[int]) -> Any:
        """``value`` (a local value of global ``shape`` held as ``have``) held as ``want``."""
        if have == want:
            return value
        if self.axis_size == 1 and not (have.partial and want.is_replicated):
            return value  # one device: every kind is the whole value (a psum stays: it marks
            # the gradient reductions the strategies schedule, and costs nothing)
        if want.is_replicated:
            return self.replicate(value, have)
        if want.partial:
            return self.to_partial(self.replicate(value, have))
        return self.block(self.replicate(value, have), want.dim, shape)

    def replicate(self, value: Any, have: Kind) -> Any:
        if have.partial:
            return lax.psum(value, self.axis_name)
        if have.dim is not None:
            return lax.all_gather(value, self.axis_name, axis=have.dim, tiled=True)
        return value

    def block(self, value: Any, dim: int, shape: Sequence[int]) -> Any:
        """This device's block of dimension ``dim`` of a replicated value: a slice, no traffic."""
        size = shape[dim] // self.axis_size
        return lax.dynamic_slice_in_dim(value, self.index() * size, size, axis=dim)

    def to_partial(self, value: Any) -> Any:
        """A replicated value as a term of a sum over devices: device 0 holds it, the others
        zero (exact, unlike dividing by ``P``)."""
        value = jnp.asarray(value)
        return jnp.where(self.index() == 0, value, jnp.zeros_like(value))
