"""``GlobalTopK``: the top-k of the sum, found in about log2 P pairwise merges (gTop-k).

Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification
for Low Bandwidth Networks" (ICDCS 2019). Per gradient bucket and step:

1. every device takes the exact top ``k`` of ``acc = residual + grad`` by magnitude
   (``k = density * n``) as a sparse vector of ``(values, indices)``;
2. **recursive doubling** with ``lax.ppermute``: in round ``r`` device ``i`` swaps its
   current ``k`` entries with device ``i XOR 2**r``; both add the two sparse vectors
   (equal indices summed) and keep the top ``k`` of the result. Both partners merge the
   same two sets in the same order, so they hold identical sets afterwards, and after
   ``log2 P`` rounds every device holds the same ``k`` indices ``G``.
   When ``P`` is not a power of two, with ``Q = 2**floor(log2 P)``, devices ``Q..P-1``
   first fold their entries into devices ``0..P-Q-1``, the ``Q`` devices run the
   doubling rounds, and the result is sent back: ``log2 Q + 2`` rounds;
3. the values at ``G`` are then summed exactly: one ``psum`` of ``k`` values of ``acc``
   at ``G`` (a dense ``k``-vector). With error feedback each device keeps ``acc`` outside
   ``G`` as its residual, so ``sent + new_residual == residual + grad`` exactly on every
   device, and the result equals the sum over devices of ``acc`` at ``G``.

Step 3 differs from the paper, which uses the merged values themselves and puts a
device's entries back into its residual when they are not in ``G``. In the paper's
version, a partial sum dropped in an early round loses the other devices' share of that
index. With step 3 the values are exact, mass is conserved exactly, and the cost is one
more all-reduce of ``k`` values.

When the devices' sparse vectors have disjoint supports, ``G`` is exactly the global
top-k of their sum: an entry of the global top-k is also in the top-k of every partial
sum that contains it. When supports overlap, the merges work on partial sums, so ``G``
can differ from the top-k of the full sum. This is the algorithm's approximation, not
an error.

The options of `jaxsched.runtime.compress._dgc` (warm-up, momentum correction with factor
masking at ``G``, local clipping) apply as in `TopK`.

Per device and step: ``log2 Q`` (plus folding) messages of ``k`` values and ``k`` int32
indices, and ``k`` values in the final all-reduce, against ``P - 1`` messages of
``k`` entries received with `TopK`'s all-gather.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxsched.runtime.collectives import BucketSpec
    >>> gtopk = GlobalTopK(density=0.25)
    >>> spec = BucketSpec(index=0, size=8, dtype=jnp.dtype("float32"), axis_size=2)
    >>> state = gtopk.init([spec])[0]
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> def body(g):
    ...     total, ((own, _)) = gtopk.all_reduce(g, "data", spec, state)
    ...     return total, own.residual[None]
    >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")),
    ...                   check_vma=False)
    >>> g = jnp.array([0, 5, 0, 1, 0, 0, 0, 2,   3, 0, 0, 0, 0, 0, 0, -4.0])
    >>> total, residual = f(jax.device_put(g, jax.NamedSharding(mesh, P("data"))))
    >>> total.tolist()           # the 2 largest of the sum, [3, 5, 0, 1, 0, 0, 0, -2]
    [3.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    >>> residual.tolist()
    [[0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -4.0]]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched._errors import JaxschedValueError
from jaxsched.runtime import kernels
from jaxsched.core._axes import AxisName
from jaxsched.runtime.collectives._base import BucketSpec
from jaxsched.runtime.compress._dgc import Sparsifier, sent_mask

__all__ = ["GlobalTopK", "GlobalTopKState", "merge_top_k", "exchange_rounds"]


class GlobalTopKState(NamedTuple):
    """One device's carried state for one bucket.

    Attributes:
      residual: error feedback, the bucket's flat shape and dtype (``(0,)`` without).
      bytes_sent: int32, payload bytes this device sent in its last step (its
        ``ppermute`` messages plus its share of the final ``k``-value all-reduce).
      rounds: int32, point-to-point rounds this device sent a message in.
      step: int32, steps taken (picks the warm-up density).
      velocity: the momentum-corrected velocity, the bucket's flat shape and dtype; ``()``
        (no array) without ``momentum``.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxsched.runtime.collectives import BucketSpec
        >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4, shapes=((10, 100),))
        >>> (own, _), = GlobalTopK(0.01, error_feedback=False).init([spec])
        >>> type(own).__name__, own.residual.shape
        ('GlobalTopKState', (0,))
    """

    residual: jax.Array
    bytes_sent: jax.Array
    rounds: jax.Array
    step: jax.Array
    velocity: jax.Array | tuple


def exchange_rounds(num_devices: int) -> list[tuple[str, list[tuple[int, int]]]]:
    """The ``(kind, ppermute pairs)`` of each round for ``num_devices``: ``"fold"``
    (extra devices send to a partner), ``"double"`` (pairwise swap), ``"unfold"``.

    Args:
      num_devices: devices on the data axis, at least 1.

    Returns:
      The rounds, in order: ``(kind, [(source, destination), ...])`` each.

    Example:
        >>> [kind for kind, _ in exchange_rounds(6)]
        ['fold', 'double', 'double', 'unfold']
        >>> exchange_rounds(4)[1]
        ('double', [(0, 2), (1, 3), (2, 0), (3, 1)])
    """
    if num_devices < 1:
        raise JaxschedValueError(f"num_devices must be >= 1, got {num_devices}")
    low = 1 << (num_devices.bit_length() - 1)
    extra = num_devices - low
    rounds = []
    if extra:
        rounds.append(("fold", [(low + j, j) for j in range(extra)]))
    bit = 1
    while bit < low:
        rounds.append(("double", [(i, i ^ bit) for i in range(low)]))
        bit <<= 1
    if extra:
        rounds.append(("unfold", [(j, low + j) for j in range(extra)]))
    return rounds


def merge_top_k(
    values_a: jax.Array, indices_a: jax.Array, values_b: jax.Array, indices_b: jax.Array, k: int, sentinel: int
) -> tuple[jax.Array, jax.Array]:
    """The top ``k`` by magnitude of the sum of two sparse vectors.

    Each input holds distinct indices, except slots at ``sentinel`` (out of range, value
    0) that mark nothing. Equal indices are summed; the result has distinct indices
    again (freed slots get ``sentinel``). Symmetric up to the order of float addition of
    two numbers, which is exact: ``merge(a, b) == merge(b, a)``.

    Args:
      values_a: the first vector's values.
      indices_a: their indices.
      values_b: the second vector's values.
      indices_b: their indices.
      k: how many entries to keep.
      sentinel: the index of an empty slot.

    Returns:
      ``(values, indices)``: the ``k`` largest entries of the sum by magnitude.

    Example:
        >>> import jax.numpy as jnp
        >>> v, i = merge_top_k(jnp.array([5.0, 1.0]), jnp.array([1, 3]),
        ...                    jnp.array([-4.0, 2.0]), jnp.array([7, 3]), k=2, sentinel=8)
        >>> v.tolist(), i.tolist()
        ([5.0, -4.0], [1, 7])
    """
    indices, values = lax.sort(
        (jnp.concatenate([indices_a, indices_b]), jnp.concatenate([values_a, values_b])), num_keys=1
    )
    same = indices[:-1] == indices[1:]
    zero = jnp.zeros((), values.dtype)
    values = values + jnp.concatenate([jnp.where(same, values[1:], zero), zero[None]])
    dropped = jnp.concatenate([jnp.zeros((1,), bool), same])
    values = jnp.where(dropped, zero, values)
    indices = jnp.where(dropped, sentinel, indices)
    _, top = lax.top_k(jnp.abs(values), k)
    return values[top], indices[top]


class GlobalTopK(Sparsifier):
    """Global top-k sparsification (gTop-k) with error feedback, by recursive doubling.

    Args:
      density: fraction of each bucket's entries selected per step, in (0, 1]; or one
        per bucket, or a function of the `BucketSpec` (layer-wise, LAGS).
      error_feedback: keep what was not selected globally for the next step.
      inner: the collective uncompressed operations (parameter all-gathers) go through.
      warmup_steps, warmup_density, warmup_tiers, momentum, clip_norm: Deep Gradient
        Compression's warm-up, momentum correction (for an optimizer without momentum)
        and local clipping; keyword-only, see `Sparsifier`.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxsched.runtime.collectives import BucketSpec
        >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4, shapes=((10, 100),))
        >>> gtopk = GlobalTopK(0.01)
        >>> (own, _), = gtopk.init([spec])
        >>> own._fields, gtopk.sim_compression().kind
        (('residual', 'bytes_sent', 'rounds', 'step', 'velocity'), 'gtopk')
    """

    sim_kind = "gtopk"

    def __repr__(self) -> str:
        return f"GlobalTopK({self._options_repr()})"

    def init_own(self, bucket: BucketSpec) -> GlobalTopKState:
        zero = jnp.zeros((), jnp.int32)
        return GlobalTopKState(
            jnp.zeros((self.residual_size(bucket),), bucket.dtype), zero, zero, zero, self.init_velocity(bucket)
        )

    def global_indices(
        self, acc: jax.Array, axis_name: AxisName, bucket: BucketSpec, density: float | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """The ``k`` indices every device agrees on (``n`` marks an empty slot), and how
        many messages this device sent to find them, at ``density`` (default: the density
        after warm-up). Runs inside the per-device body.

        Args:
          acc: this device's accumulated gradient (flat).
          axis_name: the data axis.
          bucket: the bucket (``bucket.size`` is ``n``).
          density: the density to select at.

        Returns:
          ``(indices, sent_messages)``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jax.sharding import PartitionSpec as P
          >>> from jaxsched.runtime.collectives import BucketSpec
          >>> from jaxsched.runtime.compress import GlobalTopK
          >>> gtopk = GlobalTopK(0.25)
          >>> spec = BucketSpec(index=0, size=8, dtype=jnp.dtype("float32"), axis_size=2)
          >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
          >>> def body(acc):
          ...     indices, sent = gtopk.global_indices(acc[0], "data", spec)
          ...     return indices[None], sent[None]
          >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P("data")), check_vma=False)
          >>> acc = jnp.array([[0, 5, 0, 1, 0, 0, 0, 2.0], [3, 0, 0, 0, 0, 0, 0, -4.0]])
          >>> indices, sent = f(jax.device_put(acc, jax.NamedSharding(mesh, P("data"))))
          >>> indices.tolist(), sent.tolist()  # 5 and 3 win; at 7, 2 - 4 is too small
          ([[1, 0], [1, 0]], [1, 1])
        """
        n, size = bucket.size, bucket.axis_size
        k = kernels.selection_size(n, self.density_of(bucket) if density is None else density)
        _, indices = lax.top_k(jnp.abs(acc), k)
        indices = indices.astype(jnp.int32)
        values = acc[indices]
        rank = lax.axis_index(axis_name)
        sent_messages = jnp.zeros((), jnp.int32)
        for kind, pairs in exchange_rounds(size):
            their_values = lax.ppermute(values, axis_name, pairs)
            their_indices = lax.ppermute(indices, axis_name, pairs)
            senders = jnp.array([src for src, _ in pairs], jnp.int32)
            receivers = jnp.array([dst for _, dst in pairs], jnp.int32)
            sent_messages += jnp.any(senders == rank).astype(jnp.int32)
            receives = jnp.any(receivers == rank)
            if kind == "unfold":  # the extra devices take the result as it is
                values = jnp.where(receives, their_values, values)
                indices = jnp.where(receives, their_indices, indices)
                continue
            if kind == "double":  # both partners merge (lower rank's set, higher rank's set)
                bit = pairs[0][0] ^ pairs[0][1]
                lower = jnp.bitwise_and(rank, bit) == 0
                first_v = jnp.where(lower, values, their_values)
                first_i = jnp.where(lower, indices, their_indices)
                second_v = jnp.where(lower, their_values, values)
                second_i = jnp.where(lower, their_indices, indices)
            else:  # fold: the receiver is the lower rank
                first_v, first_i, second_v, second_i = values, indices, their_values, their_indices
            merged_v, merged_i = merge_top_k(first_v, first_i, second_v, second_i, k, n)
            values = jnp.where(receives, merged_v, values)
            indices = jnp.where(receives, merged_i, indices)
        return indices, sent_messages

    def compress_sum(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, own: GlobalTopKState
    ) -> tuple[jax.Array, GlobalTopKState]:
        grad, velocity = self.accumulate(buffer, own.velocity)
        residual = own.residual if self.error_feedback else jnp.zeros_like(buffer)
        acc = residual + grad
        itemsize = jnp.dtype(buffer.dtype).itemsize

        def exchange(density):
            indices, messages = self.global_indices(acc, axis_name, bucket, density)
            summed = lax.psum(acc.at[indices].get(mode="fill", fill_value=0), axis_name)
            total = jnp.zeros_like(acc).at[indices].add(summed, mode="drop")
            k = indices.shape[0]
            new_residual = (
                acc.at[indices].set(jnp.zeros((), acc.dtype), mode="drop") if self.error_feedback else own.residual
            )
            sent = (messages * (k * (itemsize + 4)) + k * itemsize).astype(jnp.int32)
            mask = sent_mask(indices, jnp.asarray(k), bucket.size) if self.momentum else None
            return total, new_residual, sent, messages, mask

        total, new_residual, sent, messages, mask = self.at_scheduled_density(own.step, bucket, exchange)
        return total, GlobalTopKState(new_residual, sent, messages, own.step + 1, self.mask_velocity(velocity, mask))
