"""What every compressor shares: the gradient-only rule, checks, the bytes counter.

A compressor is a `CollectiveWrapper`: strategies send each
bucket's flat gradient buffer through it, and it carries per-device, per-bucket state
(error-feedback residuals, PowerSGD's ``Q``) in the strategy state's ``collective_state``.
Compression applies only to gradient buffers (``bucket.kind == "gradients"``): the
all-gathers of parameters that ``dear`` issues are delegated to the inner collective, exact.

``reduce_scatter`` (``dear``) is served by the same compressed exchange as
``all_reduce``: every device ends up with the whole (approximate) sum and keeps its own
``1/P`` shard of it.

Every compressor's own state is a ``NamedTuple`` with a ``bytes_sent`` field: the bytes
of compressed payload this device emitted for the bucket in its most recent step.
`bytes_sent` reads them from a scheduled state, so the user's ``aux`` tree is left
as the user wrote it.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxsched.runtime.collectives import BucketSpec
    >>> spec = BucketSpec(index=3, size=4, dtype=jnp.dtype("int32"), axis_size=2)
    >>> check_gradient_bucket(spec, "TopK")
    Traceback (most recent call last):
    ...
    jaxsched.JaxschedTypeError: TopK compresses floating gradients, but bucket 3 (shapes ()) has dtype int32; ...
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxsched._errors import JaxschedTypeError, JaxschedValueError
from jaxsched.core._axes import AxisName
from jaxsched.runtime.collectives._base import BucketSpec, Collective, CollectiveState, CollectiveWrapper

__all__ = [
    "Compressor",
    "Density",
    "bytes_sent",
    "bucket_density",
    "check_density",
    "check_density_spec",
    "check_gradient_bucket",
    "shard_of",
]

#: A compressor's density: one float for every bucket, a sequence with one float per
#: bucket (in plan order), or a function of the `BucketSpec` (layer-wise adaptive
#: sparsification, LAGS: e.g. denser small buckets, sparser large ones).
Density = Union[float, Sequence[float], Callable[[BucketSpec], float]]


def check_density(density: Any, owner: str) -> float:
    """``density`` as a float in (0, 1], or a ValueError naming ``owner``: a wrong density
    fails at construction, not inside a traced step.

    Args:
      density: the user's value.
      owner: the compressor's name, for the message.

    Returns:
      The density as a float.

    Raises:
      JaxschedTypeError: not a number.
      JaxschedValueError: outside (0, 1].

    Example:
        >>> from jaxsched.runtime.compress import check_density
        >>> check_density(1, "TopK")
        1.0
        >>> check_density(2, "TopK")
        Traceback (most recent call last):
        ...
        jaxsched.JaxschedValueError: TopK(density=2): density must be in (0, 1] ...
    """
    if isinstance(density, bool):
        raise JaxschedTypeError(f"{owner}(density={density!r}): density must be a number in (0, 1]")
    try:
        value = float(density)
    except (TypeError, ValueError):
        raise JaxschedTypeError(f"{owner}(density={density!r}): density must be a number in (0, 1]") from None
    if not 0.0 < value <= 1.0:
        raise JaxschedValueError(
            f"{owner}(density={density!r}): density must be in (0, 1] (the fraction "
            f"of each bucket's entries sent per step, e.g. 0.01)"
        )
    return value


def check_density_spec(density: Any, owner: str) -> Any:
    """Validate a `Density` at construction (a function is checked per bucket, since its
    value depends on the bucket).

    Args:
      density: a float, one float per bucket, or a function of the `BucketSpec`.
      owner: the compressor's name, for messages.

    Returns:
      A float, a tuple of floats, or the function unchanged.

    Example:
        >>> from jaxsched.runtime.compress import check_density_spec
        >>> check_density_spec([0.5, 1], "TopK")
        (0.5, 1.0)
    """
    if callable(density):
        return density
    if isinstance(density, (list, tuple)):
        if not density:
            raise JaxschedValueError(f"{owner}(density=[]): give one density per bucket, or one float")
        return tuple(check_density(d, owner) for d in density)
    return check_density(density, owner)


def bucket_density(density: Any, bucket: BucketSpec, owner: str) -> float:
    """The density of ``bucket`` under a validated `Density`.

    Args:
      density: what `check_density_spec` returned.
      bucket: the bucket being compressed.
      owner: the compressor's name, for messages.

    Returns:
      The fraction of the bucket's entries to send.

    Raises:
      JaxschedValueError: the function gives a bad value, or the sequence has no entry
        for the bucket.

    Example:
        >>> import numpy as np
        >>> from jaxsched.runtime.compress import bucket_density
        >>> from jaxsched.runtime.collectives import BucketSpec
        >>> spec = BucketSpec(index=1, size=1000, dtype=np.dtype("float32"), axis_size=2)
        >>> bucket_density(0.01, spec, "TopK"), bucket_density((0.5, 0.1), spec, "TopK")
        (0.01, 0.1)
        >>> bucket_density(lambda b: 10 / b.size, spec, "TopK")
        0.01
    """
    if callable(density):
        value = density(bucket)
        try:
            return check_density(value, owner)
        except (TypeError, ValueError):
            raise JaxschedValueError(
                f"{owner}: the density function gave {value!r} for bucket "
                f"{bucket.index} (shapes {bucket.shapes}); it must return a "
                f"number in (0, 1]"
            ) from None
    if isinstance(density, tuple):
        if bucket.index >= len(density):
            raise JaxschedValueError(
                f"{owner}: {len(density)} densities given, but the plan has bucket "
                f"{bucket.index}; give one per bucket (see sched.program.buckets)"
            )
        return density[bucket.index]
    return density


def check_gradient_bucket(bucket: BucketSpec, owner: str) -> None:
    """Refuse a gradient bucket a lossy compressor cannot handle (non-floating).

    Args:
      bucket: the bucket about to be compressed.
      owner: the compressor's name, for the message.

    Raises:
      JaxschedTypeError: the bucket's dtype is not floating.

    Example:
        >>> import numpy as np
        >>> from jaxsched.runtime.compress import check_gradient_bucket
        >>> from jaxsched.runtime.collectives import BucketSpec
        >>> check_gradient_bucket(BucketSpec(index=0, size=4, dtype=np.dtype("float32"), axis_size=2), "TopK")
    """
    if not jnp.issubdtype(bucket.dtype, jnp.floating):
        raise JaxschedTypeError(
            f"{owner} compresses floating gradients, but bucket {bucket.index} "
            f"(shapes {bucket.shapes}) has dtype {np.dtype(bucket.dtype).name}; "
            f"keep integer leaves out of the differentiated params, or schedule "
            f"without compression"
        )


def shard_of(total: jax.Array, axis_name: AxisName, bucket: BucketSpec) -> jax.Array:
    """This device's ``1/P`` slice of a full buffer (what a tiled reduce-scatter returns):
    how a compressor that all-reduces serves ``reduce_scatter``.

    Args:
      total: the full buffer, the same on every device.
      axis_name: the data-parallel axis (inside ``shard_map``).
      bucket: the bucket; its ``axis_size`` is ``P``.

    Returns:
      The device's contiguous shard of the leading dimension.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxsched.runtime.compress import shard_of
        >>> from jaxsched.runtime.collectives import BucketSpec
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> spec = BucketSpec(index=0, size=4, dtype=jnp.dtype("float32"), axis_size=2)
        >>> f = jax.shard_map(lambda x: shard_of(x, "data", spec)[:1], mesh=mesh, in_specs=P(), out_specs=P("data"))
        >>> f(jnp.arange(4.0)).tolist()  # device 0 keeps [0, 1], device 1 keeps [2, 3]
        [0.0, 2.0]
    """
    shard = total.shape[0] // bucket.axis_size
    return lax.dynamic_slice_in_dim(total, lax.axis_index(axis_name) * shard, shard)


class Compressor(CollectiveWrapper):
    """Base of the compressors: gradients go through `compress_sum`, parameters are
    delegated exactly.

    Subclasses implement ``init_own(bucket)`` (a NamedTuple with a ``bytes_sent`` field)
    and ``compress_sum(buffer, axis_name, bucket, own) -> (sum over devices, own)``.
    Sparsifiers set ``density`` and ``sim_kind`` (how the simulator models them).

    Args:
      inner: the collective uncompressed operations (parameter all-gathers) go through.

    Example:
        A compressor that sends gradients as they are (and counts nothing):

        >>> import jax, jax.numpy as jnp
        >>> from typing import NamedTuple
        >>> from jax import lax
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxsched.runtime.collectives import BucketSpec
        >>> class Own(NamedTuple):
        ...     bytes_sent: jax.Array
        >>> class Plain(Compressor):
        ...     def init_own(self, bucket):
        ...         return Own(jnp.zeros((), jnp.int32))
        ...     def compress_sum(self, buffer, axis_name, bucket, own):
        ...         return lax.psum(buffer, axis_name), own
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> spec = BucketSpec(index=0, size=2, dtype=jnp.dtype("float32"), axis_size=2)
        >>> plain = Plain()
        >>> state = plain.init([spec])[0]
        >>> f = jax.shard_map(lambda x: plain.all_reduce(x, "data", spec, state)[0],
        ...                   mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
        >>> [float(v) for v in f(jax.device_put(jnp.arange(4.0), jax.NamedSharding(mesh, P("data"))))]
        [2.0, 4.0]
    """

    exact = False
    sim_kind: str | None = None
    density: Any = None

    def sim_compression(self, selection_s_per_byte: float = 0.0):
        """This compressor as the simulator and the bucket planner model it, for
        ``jaxsched.sim.simulate(..., compression=)`` and
        ``jaxsched.plan.plan_buckets(..., planner="optimal", compression=)`` (OMGS: the
        planner then merges buckets against the compressed collective's cost and the
        selection time). Needs one density for every bucket.

        Args:
          selection_s_per_byte: the selection's time per gradient byte.

        Returns:
          A `jaxsched.sim.Compression`.

        Raises:
          JaxschedValueError: the simulator does not model this compressor, or its density
            differs per bucket.

        Example:
          >>> from jaxsched.runtime.compress import GlobalTopK, TopK
          >>> TopK(0.01).sim_compression(), GlobalTopK(0.01).sim_compression().kind
          (Compression(kind='topk', density=0.01, selection_s_per_byte=0.0), 'gtopk')
        """
        from jaxsched.sim import Compression

        if self.sim_kind is None:
            raise JaxschedValueError(f"{type(self).__name__}: the simulator does not model it")
        if not isinstance(self.density, float):
            raise JaxschedValueError(
                f"{type(self).__name__}: the simulator models one density for every bucket; got {self.density!r}"
            )
        return Compression(self.sim_kind, self.density, selection_s_per_byte)

    def density_of(self, bucket: BucketSpec) -> float:
        """This bucket's density (the same for all, per bucket, or a function: LAGS).

        Args:
          bucket: the bucket.

        Returns:
          The density in (0, 1].

        Example:
            >>> import jax.numpy as jnp
            >>> from jaxsched.runtime.collectives import BucketSpec
            >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4)
            >>> from jaxsched.runtime.compress import TopK
            >>> TopK(density=lambda bucket: 0.1 if bucket.size > 100 else 1.0).density_of(spec)
            0.1
        """
        return bucket_density(self.density, bucket, type(self).__name__)

    def __init__(self, inner: Collective | None = None):
        super().__init__(inner)

    def compresses(self, bucket: BucketSpec) -> bool:
        return bucket.kind == "gradients" and bucket.size > 0

    def init(self, buckets: Sequence[BucketSpec]) -> tuple[CollectiveState, ...]:
        for bucket in buckets:
            if self.compresses(bucket):
                check_gradient_bucket(bucket, type(self).__name__)
        return super().init(buckets)

    def compress_sum(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, own: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        raise NotImplementedError

    def all_reduce(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        if not self.compresses(bucket):
            return super().all_reduce(buffer, axis_name, bucket, state)
        own, inner = state
        check_gradient_bucket(bucket, type(self).__name__)
        total, own = self.compress_sum(buffer, axis_name, bucket, own)
        return total.astype(buffer.dtype), (own, inner)

    def reduce_scatter(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        if not self.compresses(bucket):
            return super().reduce_scatter(buffer, axis_name, bucket, state)
        own, inner = state
        check_gradient_bucket(bucket, type(self).__name__)
        total, own = self.compress_sum(buffer, axis_name, bucket, own)
        return shard_of(total.astype(buffer.dtype), axis_name, bucket), (own, inner)


def _has_bytes_counter(node: Any) -> bool:
    return isinstance(node, tuple) and "bytes_sent" in getattr(node, "_fields", ())


def bytes_sent(state: Any) -> np.ndarray:
    """Compressed bytes each device sent in its most recent step, summed over buckets.

    Args:
      state: a scheduled state (``SchedState``; its ``collective_state`` is read) or a
        ``collective_state`` tree itself.

    Returns:
      an int64 array with one entry per device (``.sum()`` is the step's traffic over
      all devices; compare with the dense ``4 * num_params`` per device in float32).
      Zeros before the first step; an empty array when the collective counts nothing.

    >>> import numpy as np
    >>> from jaxsched.runtime.compress._topk import TopKState
    >>> own = TopKState(np.zeros((2, 0)), np.array([8, 16]), np.array([1, 2]), np.zeros(2), ())
    >>> bytes_sent(((own, ()), (own, ()))).tolist()
    [16, 32]
    """
    tree = getattr(state, "collective_state", state)
    counters = [
        np.asarray(jax.device_get(node.bytes_sent), np.int64)
        for node in jax.tree.leaves(tree, is_leaf=_has_bytes_counter)
        if _has_bytes_counter(node)
    ]
    if not counters:
        return np.zeros((0,), np.int64)
    return np.sum(np.stack([c.reshape(c.shape[:1] or (1,)) for c in counters]), axis=0)
