"""``TopK``: each device sends its largest entries; everyone all-gathers and sums them.

Per gradient bucket and step, every device

1. adds its error-feedback residual to the gradient (``acc = residual + grad``);
2. selects about ``k = density * n`` entries of ``acc`` by magnitude:
   ``selection="exact"`` takes exactly ``k`` with ``lax.top_k``; ``"threshold"`` (the
   default) estimates a magnitude threshold from a random sample
   (`jaxsched.runtime.kernels.estimate_threshold`), selects with the fused error-feedback
   pass and compacts to fixed-capacity ``(values, indices)``
   (`jaxsched.runtime.kernels.threshold_error_feedback`), so no sort of size ``n`` runs;
3. keeps what it did not send as the next residual (``error_feedback=True``), so
   ``sent + new_residual == residual + grad`` exactly; without error feedback the
   unsent entries are dropped;
4. all-gathers every device's ``(values, int32 indices)`` and scatter-adds them into a
   dense buffer: the sum over devices (Aji & Heafield, 2017; Lin et al., 2018).

``bytes_sent`` counts the entries actually selected, ``count * (itemsize + 4)``; the
all-gather itself moves the fixed ``capacity`` slots per device (about ``1.25 k + 64``
with the threshold selection, ``k`` with the exact one), because shapes are static.

Deep Gradient Compression's options (keyword-only: ``warmup_steps``, ``momentum``,
``clip_norm``; `jaxsched.runtime.compress._dgc`) change step 1: the gradient is clipped, and with
momentum correction the *velocity* enters the residual. With warm-up, steps 2-4 run at the
step's tier density, each tier with its own static capacity.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxsched.runtime.collectives import BucketSpec
    >>> topk = TopK(density=0.25, selection="exact")
    >>> spec = BucketSpec(index=0, size=8, dtype=jnp.dtype("float32"), axis_size=2)
    >>> (own, inner), = topk.init([spec])
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> def body(g, residual):
    ...     state = (own._replace(residual=residual[0]), inner)
    ...     total, (new, _) = topk.all_reduce(g, "data", spec, state)
    ...     return total, new.residual[None], new.bytes_sent[None]
    >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data"), P("data")),
    ...                   check_vma=False)
    >>> g = jnp.array([0, 5, 0, 1, 0, 0, 0, 2,   3, 0, 0, 0, 0, 0, 0, -4.0])
    >>> put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, P("data")))
    >>> total, residual, sent = f(put(g), put(jnp.zeros((2, 8))))
    >>> total.tolist()          # device 0 sent 5 and 2, device 1 sent 3 and -4
    [3.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0]
    >>> residual.tolist()        # what each device keeps for the next step
    [[0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    >>> sent.tolist()            # 2 entries x (4 value bytes + 4 index bytes) per device
    [16, 16]
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxsched._errors import JaxschedValueError
from jaxsched.runtime import kernels
from jaxsched.core._axes import AxisName
from jaxsched.runtime.collectives._base import BucketSpec, Collective
from jaxsched.runtime.compress._base import Density
from jaxsched.runtime.compress._dgc import Sparsifier, sent_mask

__all__ = ["TopK", "TopKState", "SELECTIONS"]

Selection = Literal["threshold", "exact"]
SELECTIONS = ("threshold", "exact")


class TopKState(NamedTuple):
    """One device's carried state for one bucket.

    Attributes:
      residual: error feedback, the bucket's flat shape and dtype (``(0,)`` without error
        feedback): what this device selected from but did not send yet (with
        ``momentum``, DGC's accumulated velocity).
      bytes_sent: int32, compressed payload bytes this device sent in its last step.
      selected: int32, entries this device sent in its last step.
      step: int32, steps taken (seeds the threshold's random sample, and picks the
        warm-up density).
      velocity: the momentum-corrected velocity, the bucket's flat shape and dtype; ``()``
        (no array) without ``momentum``.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxsched.runtime.collectives import BucketSpec
        >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4, shapes=((10, 100),))
        >>> (own, _), = TopK(0.01).init([spec])
        >>> type(own).__name__, own.residual.shape, own.velocity
        ('TopKState', (1000,), ())
    """

    residual: jax.Array
    bytes_sent: jax.Array
    selected: jax.Array
    step: jax.Array
    velocity: jax.Array | tuple


class TopK(Sparsifier):
    """Top-k sparsification with error feedback, exchanged by all-gather.

    Args:
      density: fraction of each bucket's entries a device sends per step, in (0, 1]; or
        one per bucket, or a function of the `BucketSpec` (layer-wise, LAGS).
      error_feedback: keep the unsent part and add it to the next step's gradient.
      selection: ``"threshold"`` (sampled threshold, about ``k`` entries, no sort) or
        ``"exact"`` (exactly ``k`` with ``lax.top_k``).
      seed: seeds the threshold's random sample (per step, device and bucket).
      inner: the collective that uncompressed operations (parameter all-gathers) go through.
      warmup_steps, warmup_density, warmup_tiers, momentum, clip_norm: Deep Gradient
        Compression's warm-up, momentum correction (for an optimizer without momentum)
        and local clipping; keyword-only, see `Sparsifier`.

    Example:
        Pass it as ``jaxsched.schedule(step, collective=TopK(0.01))``; each bucket's state
        is ``(TopKState, inner state)``:

        >>> import jax.numpy as jnp
        >>> from jaxsched.runtime.collectives import BucketSpec
        >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4, shapes=((10, 100),))
        >>> topk = TopK(0.01)
        >>> topk
        TopK(density=0.01, error_feedback=True, selection='threshold')
        >>> (own, _), = topk.init([spec])
        >>> own.residual.shape, topk.capacity(spec), TopK(0.01, selection="exact").capacity(spec)
        ((1000,), 77, 10)
    """

    sim_kind = "topk"

    def __init__(
        self,
        density: Density = 0.01,
        error_feedback: bool = True,
        selection: Selection = "threshold",
        seed: int = 0,
        inner: Collective | None = None,
        *,
        warmup_steps: int = 0,
        warmup_density: float | None = None,
        warmup_tiers: int | None = None,
        momentum: float = 0.0,
        clip_norm: float | None = None,
    ):
        super().__init__(
            density,
            error_feedback,
            inner,
            warmup_steps=warmup_steps,
            warmup_density=warmup_density,
            warmup_tiers=warmup_tiers,
            momentum=momentum,
            clip_norm=clip_norm,
        )
        if selection not in SELECTIONS:
            raise JaxschedValueError(
                f"TopK(selection={selection!r}) is unknown; use one of {', '.join(map(repr, SELECTIONS))}"
            )
        self.selection = selection
        self.seed = int(seed)

    def __repr__(self) -> str:
        return f"TopK({self._options_repr()}, selection={self.selection!r})"

    def init_own(self, bucket: BucketSpec) -> TopKState:
        zero = jnp.zeros((), jnp.int32)
        return TopKState(
            jnp.zeros((self.residual_size(bucket),), bucket.dtype), zero, zero, zero, self.init_velocity(bucket)
        )

    def capacity(self, bucket: BucketSpec, density: float | None = None) -> int:
        """Slots per device in the all-gather at ``density`` (default: the density after
        warm-up, what every step moves once warm-up is over).

        Args:
          bucket: the bucket.
          density: the density to size for.

        Returns:
          The number of ``(value, index)`` slots each device sends.

        Example:
            >>> import jax.numpy as jnp
            >>> from jaxsched.runtime.collectives import BucketSpec
            >>> spec = BucketSpec(index=0, size=1000, dtype=jnp.dtype("float32"), axis_size=4)
            >>> TopK(0.01, selection="exact").capacity(spec), TopK(0.01, selection="exact").capacity(spec, 0.1)
            (10, 100)
        """
        density = self.density_of(bucket) if density is None else density
        if self.selection == "exact":
            return kernels.selection_size(bucket.size, density)
        return kernels.default_capacity(bucket.size, density)

    def select(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, own: TopKState, density: float | None = None
    ) -> kernels.SparseGradient:
        """This device's ``(values, indices)`` and new residual (error feedback applied), at
        ``density`` (default: the density after warm-up). Runs inside the per-device body.

        Args:
          buffer: this device's flat gradient buffer.
          axis_name: the data axis.
          bucket: the bucket.
          own: this bucket's `TopKState`.
          density: the density to select at.

        Returns:
          A ``kernels.SparseGradient``: the selected values and indices and the new residual.

        Example:
          With ``selection="exact"`` nothing crosses devices, so it runs outside a body too:

          >>> import jax.numpy as jnp
          >>> from jaxsched.runtime.collectives import BucketSpec
          >>> from jaxsched.runtime.compress import TopK
          >>> topk = TopK(0.25, selection="exact")
          >>> spec = BucketSpec(index=0, size=8, dtype=jnp.dtype("float32"), axis_size=2)
          >>> (own, _), = topk.init([spec])
          >>> sparse = topk.select(jnp.array([0, 5, 0, 1, 0, 0, 0, 2.0]), "data", spec, own)
          >>> sparse.values.tolist(), sparse.indices.tolist(), sparse.new_residual.tolist()
          ([5.0, 2.0], [1, 7], [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
        """
        density = self.density_of(bucket) if density is None else density
        residual = own.residual if self.error_feedback else jnp.zeros_like(buffer)
        if self.selection == "exact":
            return kernels.exact_topk_error_feedback(buffer, residual, kernels.selection_size(bucket.size, density))
        key = jax.random.fold_in(jax.random.key(self.seed), own.step)
        key = jax.random.fold_in(jax.random.fold_in(key, bucket.index), lax.axis_index(axis_name))
        return kernels.threshold_error_feedback(buffer, residual, density, key, capacity=self.capacity(bucket, density))

    def compress_sum(
        self, buffer: jax.Array, axis_name: AxisName, bucket: BucketSpec, own: TopKState
    ) -> tuple[jax.Array, TopKState]:
        grad, velocity = self.accumulate(buffer, own.velocity)

        def exchange(density):
            sparse = self.select(grad, axis_name, bucket, own, density)
            all_values = lax.all_gather(sparse.values, axis_name, tiled=True)
            all_indices = lax.all_gather(sparse.indices, axis_name, tiled=True)
            total = jnp.zeros((bucket.size,), buffer.dtype).at[all_indices].add(all_values)
            sent = sent_mask(sparse.indices, sparse.count, bucket.size) if self.momentum else None
            return total, sparse.new_residual, sparse.count, sent

        total, new_residual, count, sent = self.at_scheduled_density(own.step, bucket, exchange)
        entry_bytes = jnp.dtype(buffer.dtype).itemsize + 4
        residual = new_residual if self.error_feedback else own.residual
        return total, TopKState(residual, count * entry_bytes, count, own.step + 1, self.mask_velocity(velocity, sent))
