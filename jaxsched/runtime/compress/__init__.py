"""Gradient compression as collective wrappers: pass one to
``jaxsched.schedule(step, strategy="wfbp" | "dear", compression=...)``.

- [`TopK`][jaxsched.runtime.compress.TopK]: top-k (threshold or exact) with error feedback, exchanged by all-gather.
- [`GlobalTopK`][jaxsched.runtime.compress.GlobalTopK]: gTop-k, the top-k of the sum in log2 P
  pairwise ``ppermute`` merges.
- [`PowerSGD`][jaxsched.runtime.compress.PowerSGD]: low-rank compression of a bucket's matrices (``wfbp`` only).
- [`Cast`][jaxsched.runtime.compress.Cast]: reduce in a narrower dtype (``jnp.bfloat16``).
- [`Quantize`][jaxsched.runtime.compress.Quantize]: 4- or 8-bit codes with per-block scales and error feedback (DiLoCo's
  outer gradients).
- `bytes_sent`: bytes each device sent in its last step, read from the scheduled state.

``TopK`` and ``GlobalTopK`` also take Deep Gradient Compression's options (keyword-only,
`jaxsched.runtime.compress._dgc`): ``warmup_steps`` (the density decays from 25 % to
``density`` over the first steps), ``momentum`` (momentum correction and factor masking,
for an optimizer without momentum such as ``optax.sgd(lr)``) and ``clip_norm``.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import jaxsched
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(16,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.sgd(0.1)
    >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="wfbp",
    ...                           compression=TopK(density=0.1, selection="exact"))
    >>> state = sched.init(params, tx.init(params))
    >>> batch = steps.shard_batch((jnp.ones((4, 8, 8, 1)), jnp.zeros(4, "int32")), mesh)
    >>> state, aux = sched(state, batch)
    >>> dense = 4 * sum(p.size for p in jax.tree.leaves(params))
    >>> sent = bytes_sent(state)          # one entry per device
    >>> sent.shape, bool((sent < dense / 4).all())
    ((2,), True)
"""

from jaxsched import _deprecations

from jaxsched.runtime.compress._base import Compressor, bytes_sent
from jaxsched.runtime.compress._cast import Cast, CastState
from jaxsched.runtime.compress._dgc import Sparsifier
from jaxsched.runtime.compress._gtopk import GlobalTopK, GlobalTopKState
from jaxsched.runtime.compress._powersgd import PowerSGD, PowerSGDState
from jaxsched.runtime.compress._quantize import Quantize, QuantizeState
from jaxsched.runtime.compress._topk import TopK, TopKState

# every private module's public names, explicitly
from jaxsched.runtime.compress._base import (
    Density,
    bucket_density,
    check_density,
    check_density_spec,
    check_gradient_bucket,
    shard_of,
)
from jaxsched.runtime.compress._dgc import DEFAULT_WARMUP_DENSITY, TIER_FACTOR, sent_mask
from jaxsched.runtime.compress._gtopk import merge_top_k, exchange_rounds
from jaxsched.runtime.compress._powersgd import matrix_view
from jaxsched.runtime.compress._quantize import dequantize, quantize
from jaxsched.runtime.compress._topk import SELECTIONS

__all__ = [
    "Cast",
    "CastState",
    "Compressor",
    "DEFAULT_WARMUP_DENSITY",
    "Density",
    "GlobalTopK",
    "GlobalTopKState",
    "PowerSGD",
    "PowerSGDState",
    "Quantize",
    "QuantizeState",
    "SELECTIONS",
    "Sparsifier",
    "TIER_FACTOR",
    "TopK",
    "TopKState",
    "bucket_density",
    "bytes_sent",
    "check_density",
    "check_density_spec",
    "check_gradient_bucket",
    "dequantize",
    "exchange_rounds",
    "matrix_view",
    "merge_top_k",
    "quantize",
    "sent_mask",
    "shard_of",
]


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
