"""``Cast``: reduce gradients in a narrower floating dtype (e.g. ``bfloat16``).

Each gradient buffer is cast to ``dtype``, reduced (``psum`` or tiled ``psum_scatter``)
in that dtype, and cast back. That is PyTorch DDP's ``bf16_compress_hook``, with a sum
where the hook takes a mean. Parameter all-gathers stay exact. Nothing is carried
between steps except the bytes counter.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxsched.runtime.collectives import BucketSpec
    >>> cast = Cast(jnp.bfloat16)
    >>> spec = BucketSpec(0, 2, jnp.dtype("float32"), 2)
    >>> state = cast.init([spec])[0]
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> f = jax.shard_map(lambda g: cast.all_reduce(g, "data", spec, state)[0], mesh=mesh,
    ...                   in_specs=P("data"), out_specs=P(), check_vma=False)
    >>> g = jax.device_put(jnp.array([1.0, 1.001,  1.0, 0.0]), jax.NamedSharding(mesh, P("data")))
    >>> f(g).tolist()   # 1.001 is not a bfloat16
    [2.0, 1.0]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched._errors import JaxschedTypeError
from jaxsched.core._axes import AxisName
from jaxsched.runtime.collectives._base import BucketSpec, Collective, CollectiveState, psum_scatter
from jaxsched.runtime.compress._base import Compressor, check_gradient_bucket

__all__ = ["Cast", "CastState"]


class CastState(NamedTuple):
    """One device's carried state for one bucket.

    Attributes:
      bytes_sent: int32, bytes of the narrow buffer this device reduced in its last step.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxsched.runtime.collectives import BucketSpec
        >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4, shapes=((10, 100),))
        >>> (own, _), = Cast().init([spec])
        >>> own
        CastState(bytes_sent=Array(0, dtype=int32))
    """

    bytes_sent: jax.Array


class Cast(Compressor):
    """Gradient reductions in ``dtype``.

    Args:
      dtype: a floating dtype, e.g. ``jnp.bfloat16`` or ``jnp.float16``.
      inner: the collective uncompressed operations (parameter all-gathers) go through.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxsched.runtime.collectives import BucketSpec
        >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4, shapes=((10, 100),))
        >>> cast = Cast(jnp.bfloat16)
        >>> (own, _), = cast.init([spec])
        >>> cast, own._fields
        (Cast(bfloat16), ('bytes_sent',))
    """

    def __init__(self, dtype: Any = jnp.bfloat16, inner: Collective | None = None):
        super().__init__(inner)
        try:
            self.dtype = jnp.dtype(dtype)
        except TypeError:
            raise JaxschedTypeError(f"Cast(dtype={dtype!r}): not a dtype; use e.g. jnp.bfloat16") from None
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise JaxschedTypeError(
                f"Cast(dtype={self.dtype.name}): reducing gradients needs a floating "
                f"dtype, e.g. jnp.bfloat16 or jnp.float16"
            )

    def __repr__(self) -> str:
        return f"Cast({self.dtype.name})"

    def init_own(self, bucket: BucketSpec) -> CastState:
        return CastState(jnp.zeros((), jnp.int32))

    def _sent(self, bucket: BucketSpec) -> CastState:
        return CastState(jnp.int32(bucket.size * self.dtype.itemsize))

    def all_reduce(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        if not self.compresses(bucket):
            return super().all_reduce(buffer, axis_name, bucket, state)
        check_gradient_bucket(bucket, "Cast")
        total = lax.psum(buffer.astype(self.dtype), axis_name).astype(buffer.dtype)
        return total, (self._sent(bucket), state[1])

    def reduce_scatter(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, state: CollectiveState
    ) -> tuple[jax.Array, CollectiveState]:
        if not self.compresses(bucket):
            return super().reduce_scatter(buffer, axis_name, bucket, state)
        check_gradient_bucket(bucket, "Cast")
        shard = psum_scatter(buffer.astype(self.dtype), axis_name, bucket).astype(buffer.dtype)
        return shard, (self._sent(bucket), state[1])
