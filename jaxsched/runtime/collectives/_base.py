"""The collective seam: how one bucket's flat buffer crosses the data axis.

Strategies never call ``lax.psum`` on gradients themselves: they call a
[`Collective`][jaxsched.runtime.collectives.Collective]. Compression, casts and
hierarchical collectives wrap one
([`CollectiveWrapper`][jaxsched.runtime.collectives.CollectiveWrapper], the way optax
wraps an inner transformation) and so apply to every strategy without editing it.

A collective may carry state between steps (error-feedback residuals). That state is
*per device* and per bucket: ``init`` returns one device's template for each bucket,
and the strategy keeps every device's copy, stacked on a leading device axis, in its
state's ``collective_state`` field.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> spec = BucketSpec(index=0, size=4, dtype=jnp.dtype("float32"), axis_size=2)
    >>> def body(x):
    ...     out, _ = PlainCollective().all_reduce(x, "data", spec, ())
    ...     return out
    >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
    >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))
    >>> [float(v) for v in f(x)]
    [4.0, 6.0, 8.0, 10.0]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsched._errors import JaxschedValueError
from jaxsched.core._torus import SMALL_TENSOR_BYTES, staged_psum_scatter
from jaxsched.core._axes import AxisName

__all__ = [
    "BucketSpec",
    "Collective",
    "CollectiveState",
    "CollectiveWrapper",
    "FORMS",
    "OPERATIONS",
    "PlainCollective",
    "SMALL_TENSOR_BYTES",
    "nbytes",
    "psum_scatter",
    "stack_local",
    "stacked_zeros",
    "unstack_local",
]

#: What a collective carries between steps for one bucket (error feedback, momentum, byte
#: counters): a pytree of arrays of the collective's own making, ``()`` when it carries
#: nothing; a wrapper's is ``(own, inner state)``.
CollectiveState = Any


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    """What a collective knows of the bucket it moves.

    Attributes:
      index: the bucket's position in the plan (issue order).
      size: elements of the full flat buffer (``P * shard`` for sharded buffers).
      dtype: the buffer's dtype (buckets never mix dtypes).
      axis_size: devices ``P`` on the data axis.
      shapes: the full shape of every tensor in the buffer, in order (a compressor that
        needs matrices, such as PowerSGD, recovers them from here).
      interleaved: False: the buffer is the tensors flattened and concatenated.
        True: the interleaved shard layout of `jaxsched.core._layout.BucketLayout`
        (each device's chunk of every tensor, device after device), as reduce-scatter
        and all-gather buffers are laid out.
      kind: ``"gradients"`` or ``"parameters"`` (what the buffer holds; lossy
        compression must leave parameters exact).
      form: how the plain collective's ``*_tensors`` methods send the bucket (one of
        `FORMS`; the engine decides per platform,
        `jaxsched.runtime.engine.Engine.collective_form`). A collective that overrides the
        buffer method (a compressor) always gets the packed buffer.
      mesh_axes: the data-parallel mesh axes the bucket crosses, ``(name, size)`` each, in
        the order of the step's data axis (empty when not known): a hierarchical
        collective splits the sum by them.
      scatter_stages: empty, or the ``axis_index_groups`` of each stage a reduce-scatter of
        the bucket runs in (`jaxsched.runtime.collectives._torus.scatter_stages`):
        XLA:TPU turns one reduce-scatter over a 3-D group of chips into an all-reduce of
        the whole buffer, and keeps two over smaller groups that leave every device the
        same slice (a stage over pairs of chips runs as an exchange of halves,
        `jaxsched.runtime.collectives.staged_psum_scatter`).
      scatter_lanes: 0, or the row length a flat (1-D) buffer is reduce-scattered as: a
        1-D reduce-scatter becomes an all-reduce of the whole buffer on TPU (any group),
        rows of 128 stay a reduce-scatter. Used where a device's slice is whole rows.

    Example:
        >>> import jax.numpy as jnp
        >>> spec = BucketSpec(index=0, size=12, dtype=jnp.dtype("float32"), axis_size=4, shapes=((3, 4),))
        >>> spec.form, spec.kind, nbytes(jnp.zeros(spec.shapes[0]))
        ('mixed', 'gradients', 48)
    """

    index: int
    size: int
    dtype: np.dtype
    axis_size: int
    shapes: tuple[tuple[int, ...], ...] = ()
    interleaved: bool = False
    kind: str = "gradients"
    form: str = "mixed"
    mesh_axes: tuple[tuple[str, int], ...] = ()
    scatter_stages: tuple = ()
    scatter_lanes: int = 0


#: How a bucket's tensors travel: ``"mixed"``, large tensors as they are and small ones
#: (<= `SMALL_TENSOR_BYTES`) packed together (all-reduce), one interleaved buffer
#: (reduce-scatter, all-gather); ``"per_tensor"``, one collective per tensor in its own
#: shape; ``"packed"``, one flat buffer per bucket.
FORMS = ("mixed", "per_tensor", "packed")
#: The bucket operations whose form can be chosen.
OPERATIONS = ("all_reduce", "reduce_scatter", "all_gather")


class Collective:
    """Plain collectives: ``psum``, tiled ``psum_scatter`` and tiled ``all_gather``.

    Every method runs inside the per-device body and returns ``(result, new_state)``
    where ``state`` is this bucket's entry of `init`.

    Args:
      forms: per operation (``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``), the
        form of `FORMS` to send buckets in, overriding the engine's per-platform
        choice (``BucketSpec.form``); e.g. ``Collective(forms={"all_reduce": "packed"})``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> spec = BucketSpec(index=0, size=4, dtype=jnp.dtype("float32"), axis_size=2)
        >>> collective = Collective(forms={"all_reduce": "packed"})
        >>> collective.form("all_reduce", spec), collective.init([spec])
        ('packed', ((),))
        >>> def body(x):
        ...     out, _ = collective.all_reduce(x, "data", spec, ())
        ...     return out
        >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
        >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))
        >>> [float(v) for v in f(x)]
        [4.0, 6.0, 8.0, 10.0]
    """

    #: per operation, the form that overrides the engine's (see Args)
    forms: dict = {}

    def __init__(self, forms: dict[str, str] | None = None):
        forms = dict(forms or {})
        for op, form in forms.items():
            if op not in OPERATIONS:
                raise JaxschedValueError(f"forms: {op!r} is not an operation; choose from {', '.join(OPERATIONS)}")
            if form not in FORMS:
                raise JaxschedValueError(f"forms[{op!r}] = {form!r}; choose from {', '.join(FORMS)}")
        self.forms = forms

    def form(self, op: str, bucket: BucketSpec) -> str:
        """The form ``op`` sends ``bucket`` in: this collective's override, else the engine's.

        Args:
          op: one of `OPERATIONS`.
          bucket: the bucket; its ``form`` is the engine's choice.

        Returns:
          One of `FORMS`.

        Example:
            >>> import jax.numpy as jnp
            >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4)
            >>> Collective(forms={"all_reduce": "per_tensor"}).form("all_reduce", spec)
            'per_tensor'
            >>> Collective().form("all_gather", spec)  # the engine's choice
            'mixed'
        """
        return self.forms.get(op, bucket.form)

    #: Whether the collective changes the numbers (lossy compression). Exact wrappers
    #: (a wider accumulator, a hierarchy) keep strategies' equivalence guarantees.
    exact: bool = True

    def init(self, buckets: Sequence[BucketSpec]) -> tuple[CollectiveState, ...]:
        """One device's carried state for each bucket (arrays without a device axis).

        Args:
          buckets: the plan's buckets, in issue order.

        Returns:
          A tuple with one state per bucket (``()`` for the plain collective).

        Example:
            >>> import jax.numpy as jnp
            >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4)
            >>> Collective().init([spec, spec])
            ((), ())
        """
        return tuple(() for _ in buckets)

    def all_reduce(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        """The flat buffer summed over ``axis_name`` (inside the per-device body).

        Args:
          buffer: this device's flat bucket buffer.
          axis_name: the data axis (or axes).
          bucket: what the buffer holds.
          state: this bucket's entry of `init`.

        Returns:
          ``(sum, new_state)``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime.collectives import BucketSpec, Collective
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> spec = BucketSpec(index=0, size=4, dtype=jnp.dtype("float32"), axis_size=2, shapes=((2, 2),))
          >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))  # [0..3] and [4..7]
          >>> f = jax.shard_map(lambda b: Collective().all_reduce(b, "data", spec, ())[0],
          ...                   mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
          >>> f(x).tolist()
          [4.0, 6.0, 8.0, 10.0]
        """
        return lax.psum(buffer, axis_name), state

    def all_reduce_tensors(
        self, tensors: Sequence[jax.Array], axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[list[jax.Array], CollectiveState]:
        """One bucket's tensors summed over ``axis_name``, each in its own shape and dtype.

        The plain psum sends large tensors as they are: packing them into one buffer and
        slicing it back costs two copies of the bucket (XLA:CPU's concatenate moves about
        1 GB/s), on the compute path, for the same sums element by element. Tensors of at
        most `SMALL_TENSOR_BYTES` share one buffer.
        A collective that overrides `all_reduce` (compression, casts) gets the
        flattened, concatenated buffer that `BucketSpec` describes. With
        ``bucket.form == "per_tensor"`` every tensor is its own psum (a multi-operand psum
        becomes one tuple all-reduce, which XLA:TPU runs synchronously); with ``"packed"``
        the bucket is one flat buffer.

        Args:
          tensors: the bucket's tensors on this device.
          axis_name: the data axis (or axes).
          bucket: the bucket's `BucketSpec`.
          state: this bucket's entry of `init`.

        Returns:
          ``(sums, new_state)``: the summed tensors, in order.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime.collectives import BucketSpec, Collective
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> spec = BucketSpec(index=0, size=4, dtype=jnp.dtype("float32"), axis_size=2, shapes=((2, 2),))
          >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))  # [0..3] and [4..7]
          >>> def body(b):
          ...     (total,), _ = Collective().all_reduce_tensors([b.reshape(2, 2)], "data", spec, ())
          ...     return total
          >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
          >>> f(x).tolist()  # in the tensor's own shape
          [[4.0, 6.0], [8.0, 10.0]]
        """
        form = self.form("all_reduce", bucket)
        if type(self).all_reduce is Collective.all_reduce and form != "packed":
            if form == "per_tensor":
                return [lax.psum(t, axis_name) for t in tensors], state
            small = [i for i, t in enumerate(tensors) if nbytes(t) <= SMALL_TENSOR_BYTES]
            if len(small) < 2:
                return list(lax.psum(tuple(tensors), axis_name)), state
            # Small tensors travel in one buffer: each psum pays a start-up (on gloo about
            # 5 ms after a large one), and copying them is cheap.
            large = [i for i in range(len(tensors)) if i not in small]
            small_tensors = [tensors[i] for i in small]
            sums = list(lax.psum(tuple(tensors[i] for i in large), axis_name)) + _split(
                lax.psum(_pack(small_tensors, bucket.dtype), axis_name), small_tensors
            )
            out = list(tensors)
            for i, total in zip(large + small, sums, strict=True):
                out[i] = total
            return out, state
        total, state = self.all_reduce(_pack(tensors, bucket.dtype), axis_name, bucket, state)
        return _split(total, tensors), state

    def reduce_scatter_tensors(
        self, tensors: Sequence[jax.Array], axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[list[jax.Array], CollectiveState]:
        """One bucket's full tensors in; out, this device's flat chunk of each sum
        (`jaxsched.core._layout.chunk_size` elements, as `BucketLayout`
        cuts it).

        By default the tensors travel as one interleaved buffer (one reduce-scatter). With
        ``bucket.form == "per_tensor"`` (and a collective that does not override
        `reduce_scatter`), each tensor is scattered on its own, along its leading
        dimension when ``P`` divides it (the same chunk, row-major), flat and padded
        otherwise.

        Args:
          tensors: the bucket's full tensors on this device.
          axis_name: the data axis (or axes).
          bucket: the bucket's `BucketSpec` (``bucket.shapes`` gives the layout).
          state: this bucket's entry of `init`.

        Returns:
          ``(chunks, new_state)``: this device's flat chunk of each tensor's sum.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime.collectives import BucketSpec, Collective
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> spec = BucketSpec(index=0, size=4, dtype=jnp.dtype("float32"), axis_size=2, shapes=((2, 2),))
          >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))  # [0..3] and [4..7]
          >>> def body(b):
          ...     (chunk,), _ = Collective().reduce_scatter_tensors([b.reshape(2, 2)], "data", spec, ())
          ...     return chunk
          >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
          >>> f(x).tolist()  # device 0 holds row 0 of the sum, device 1 row 1
          [4.0, 6.0, 8.0, 10.0]
        """
        from jaxsched.core._layout import BucketLayout, pad_flat

        layout = BucketLayout.of(bucket.shapes, [bucket.dtype] * len(bucket.shapes), bucket.axis_size)
        if (
            self.form("reduce_scatter", bucket) == "per_tensor"
            and type(self).reduce_scatter is Collective.reduce_scatter
        ):
            p = bucket.axis_size
            chunks = []
            for t, c in zip(tensors, layout.chunk_sizes, strict=True):
                if np.ndim(t) >= 1 and np.shape(t)[0] % p == 0:
                    part = psum_scatter(t, axis_name, bucket)
                else:
                    part = psum_scatter(pad_flat(t, c * p), axis_name, bucket)
                chunks.append(part.reshape(-1))
            return chunks, state
        shard, state = self.reduce_scatter(layout.pack(tensors), axis_name, bucket, state)
        return layout.split_shard(shard), state

    def all_gather_tensors(
        self, chunks: Sequence[jax.Array], axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[list[jax.Array], CollectiveState]:
        """Each tensor's flat chunk on this device in; the full tensors (``bucket.shapes``)
        out. The inverse of `reduce_scatter_tensors`, with the same two forms.

        Args:
          chunks: this device's flat chunk of each tensor.
          axis_name: the data axis (or axes).
          bucket: the bucket's `BucketSpec`.
          state: this bucket's entry of `init`.

        Returns:
          ``(tensors, new_state)``: the full tensors, in ``bucket.shapes``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime.collectives import BucketSpec, Collective
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> spec = BucketSpec(index=0, size=4, dtype=jnp.dtype("float32"), axis_size=2, shapes=((2, 2),))
          >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))  # [0..3] and [4..7]
          >>> def body(chunk):
          ...     (full,), _ = Collective().all_gather_tensors([chunk], "data", spec, ())
          ...     return full
          >>> y = jax.device_put(jnp.arange(4.0), jax.NamedSharding(mesh, P("data")))  # [0, 1] and [2, 3]
          >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
          >>> f(y).tolist()
          [[0.0, 1.0], [2.0, 3.0]]
        """
        from jaxsched.core._layout import BucketLayout

        layout = BucketLayout.of(bucket.shapes, [bucket.dtype] * len(bucket.shapes), bucket.axis_size)
        if self.form("all_gather", bucket) == "per_tensor" and type(self).all_gather is Collective.all_gather:
            p = bucket.axis_size
            full = []
            for chunk, shape in zip(chunks, layout.shapes, strict=True):
                if len(shape) >= 1 and shape[0] % p == 0:
                    block = chunk.reshape((shape[0] // p,) + tuple(shape[1:]))
                    full.append(lax.all_gather(block, axis_name, axis=0, tiled=True))
                else:
                    flat = lax.all_gather(chunk, axis_name, tiled=True)
                    full.append(flat[: int(np.prod(shape))].reshape(shape))
            return full, state
        gathered, state = self.all_gather(layout.join_chunks(chunks), axis_name, bucket, state)
        return layout.unpack(gathered), state

    def reduce_scatter(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        """The full buffer in, this device's ``1/P`` slice of the sum out.

        Args:
          buffer: this device's full flat buffer.
          axis_name: the data axis (or axes).
          bucket: what the buffer holds.
          state: this bucket's entry of `init`.

        Returns:
          ``(shard, new_state)``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime.collectives import BucketSpec, Collective
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> spec = BucketSpec(index=0, size=4, dtype=jnp.dtype("float32"), axis_size=2, shapes=((2, 2),))
          >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))  # [0..3] and [4..7]
          >>> f = jax.shard_map(lambda b: Collective().reduce_scatter(b, "data", spec, ())[0],
          ...                   mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
          >>> f(x).tolist()  # device 0 holds [4, 6], device 1 [8, 10]
          [4.0, 6.0, 8.0, 10.0]
        """
        return psum_scatter(buffer, axis_name, bucket), state

    def all_gather(
        self, shard: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        """Every device's shard in, the concatenated full buffer out.

        Args:
          shard: this device's slice.
          axis_name: the data axis (or axes).
          bucket: what the buffer holds.
          state: this bucket's entry of `init`.

        Returns:
          ``(buffer, new_state)``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime.collectives import BucketSpec, Collective
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> spec = BucketSpec(index=0, size=4, dtype=jnp.dtype("float32"), axis_size=2, shapes=((2, 2),))
          >>> x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("data")))  # [0..3] and [4..7]
          >>> f = jax.shard_map(lambda s: Collective().all_gather(s[:2], "data", spec, ())[0],
          ...                   mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
          >>> f(x).tolist()  # each device's first two entries, in device order
          [0.0, 1.0, 4.0, 5.0]
        """
        return lax.all_gather(shard, axis_name, tiled=True), state


PlainCollective = Collective


def psum_scatter(x: jax.Array, axis_name: AxisName, bucket: BucketSpec) -> jax.Array:
    """Tiled ``psum_scatter`` of ``x`` along its leading dimension: this device's ``1/P`` of
    the sum, in the form the target keeps a reduce-scatter in (`BucketSpec`): a flat
    buffer as rows of ``bucket.scatter_lanes``, in the stages ``bucket.scatter_stages``
    names (one reduce-scatter if none, or for a tensor of at most `SMALL_TENSOR_BYTES`:
    XLA:TPU makes an all-reduce of so few rows anyway, and one costs less than two). Every
    form hands each device the same slice.

    Args:
      x: this device's buffer (inside ``shard_map``); its leading dimension divides by ``P``.
      axis_name: the data-parallel axis.
      bucket: the bucket ``x`` belongs to, with its target's lanes and stages.

    Returns:
      This device's ``1/P`` of the sum over ``axis_name``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxsched.runtime.collectives import BucketSpec, psum_scatter
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> spec = BucketSpec(index=0, size=4, dtype=jnp.dtype("float32"), axis_size=2)
        >>> f = jax.shard_map(lambda x: psum_scatter(x, "data", spec), mesh=mesh, in_specs=P(), out_specs=P("data"))
        >>> f(jnp.arange(4.0)).tolist()  # the sum of two copies, device d keeps slice d
        [0.0, 2.0, 4.0, 6.0]
    """
    lanes, flat = bucket.scatter_lanes, np.ndim(x) == 1
    rows = flat and lanes > 0 and np.shape(x)[0] % (bucket.axis_size * lanes) == 0
    if rows:
        x = x.reshape(-1, lanes)
    stages = bucket.scatter_stages if nbytes(x) > SMALL_TENSOR_BYTES else ()
    x = staged_psum_scatter(x, axis_name, 0, stages)
    return x.reshape(-1) if rows else x


def nbytes(t: jax.Array | jax.ShapeDtypeStruct | np.ndarray) -> int:
    """The bytes of one tensor (an array or a tracer): what a collective of it moves.

    Args:
      t: an array, a tracer or a ``jax.ShapeDtypeStruct``.

    Returns:
      Its size times its dtype's item size.

    Example:
        >>> import numpy as np
        >>> from jaxsched.runtime.collectives import nbytes
        >>> nbytes(np.zeros((3, 4), np.float32))
        48
    """
    return int(np.prod(np.shape(t))) * jnp.dtype(jnp.result_type(t)).itemsize


def _pack(tensors: Sequence[jax.Array], dtype: jnp.dtype | np.dtype) -> jax.Array:
    return jnp.concatenate([jnp.ravel(t).astype(dtype) for t in tensors])


def _split(flat: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
    out, offset = [], 0
    for t in like:
        size = int(np.prod(np.shape(t)))
        out.append(flat[offset : offset + size].reshape(np.shape(t)).astype(jnp.result_type(t)))
        offset += size
    return out


class CollectiveWrapper(Collective):
    """A collective that changes some operations and delegates the rest to ``inner``.

    Its own state for a bucket is ``(own, inner_state)``, so wrappers nest like optax's.
    Subclasses override ``init_own`` and the operations they change.

    Args:
      inner: the collective the unchanged operations go to (default: a plain `Collective`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> class Mean(CollectiveWrapper):
        ...     def all_reduce(self, buffer, axis_name, bucket, state):
        ...         total, state = super().all_reduce(buffer, axis_name, bucket, state)
        ...         return total / bucket.axis_size, state
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> spec = BucketSpec(index=0, size=2, dtype=jnp.dtype("float32"), axis_size=2)
        >>> mean = Mean()
        >>> mean.init([spec])  # (own, inner) per bucket
        (((), ()),)
        >>> f = jax.shard_map(lambda x: mean.all_reduce(x, "data", spec, ((), ()))[0],
        ...                   mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
        >>> x = jax.device_put(jnp.arange(4.0), jax.NamedSharding(mesh, P("data")))
        >>> [float(v) for v in f(x)]
        [1.0, 2.0]
    """

    def __init__(self, inner: Collective | None = None):
        self.inner = inner if inner is not None else Collective()
        self.exact = self.exact and self.inner.exact

    def init_own(self, bucket: BucketSpec) -> CollectiveState:
        return ()

    def init(self, buckets: Sequence[BucketSpec]) -> tuple[CollectiveState, ...]:
        return tuple((self.init_own(b), s) for b, s in zip(buckets, self.inner.init(buckets), strict=True))

    def all_reduce(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        own, inner = state
        out, inner = self.inner.all_reduce(buffer, axis_name, bucket, inner)
        return out, (own, inner)

    def reduce_scatter(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        own, inner = state
        out, inner = self.inner.reduce_scatter(buffer, axis_name, bucket, inner)
        return out, (own, inner)

    def all_gather(
        self, shard: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        own, inner = state
        out, inner = self.inner.all_gather(shard, axis_name, bucket, inner)
        return out, (own, inner)


def stacked_zeros(template: CollectiveState, axis_size: int) -> CollectiveState:
    """Every device's copy of a per-device state template, on a leading device axis.

    Args:
      template: one device's state (arrays or ``jax.ShapeDtypeStruct`` leaves).
      axis_size: the number of devices ``P``.

    Returns:
      The template's tree of zeros, each leaf with a leading axis of ``axis_size``.

    Example:
        >>> import jax.numpy as jnp
        >>> stacked_zeros({"residual": jnp.ones(3)}, 2)["residual"].shape
        (2, 3)
    """
    return jax.tree.map(
        lambda a: jnp.zeros((axis_size,) + tuple(np.shape(a)), jnp.asarray(a).dtype)
        if not isinstance(a, jax.ShapeDtypeStruct)
        else jnp.zeros((axis_size,) + tuple(a.shape), a.dtype),
        template,
    )


def unstack_local(leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """Inside the body: this device's ``(1, ...)`` blocks of per-device state, without the axis.

    Args:
      leaves: this device's blocks of stacked per-device state.

    Returns:
      The blocks without their leading axis.

    Example:
        >>> import jax.numpy as jnp
        >>> [x.shape for x in unstack_local([jnp.zeros((1, 3))])]
        [(3,)]
    """
    return [leaf[0] for leaf in leaves]


def stack_local(leaves: Sequence[jax.Array]) -> list[jax.Array]:
    return [leaf[None] for leaf in leaves]
