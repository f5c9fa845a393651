"""The optax optimizers a user reaches for, each with a schedule and (where it has weight
decay) a mask, on a small MLP whose leaf sizes do not divide by 8; and what ``dear`` makes
of each: fallbacks, collectives in the lowered program, optimizer state per device.

Shared by ``tests/test_dear_optimizers.py`` and ``benchmarks/dear_optimizers.py``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
import numpy as np
import optax

import jaxsched
from jaxsched.demo import steps
from support.equivalence import build, random_batches
from support.hlo_counts import collectives

SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=20)


def decay_mask(params: Any) -> Any:
    """Weight decay on kernels only (the usual mask: no decay of biases)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: jax.tree_util.keystr(path).endswith("['kernel']"), params)


def _muon() -> optax.GradientTransformation:
    return optax.contrib.muon(SCHEDULE)


def _frozen_head() -> optax.GradientTransformation:
    """big_vision's shape: a labelled chain, frozen leaves set to zero, decay on the rest."""
    labels = lambda p: {k: jax.tree.map(lambda _: "frozen" if k == "head" else "trained", v) for k, v in p.items()}
    return optax.multi_transform(
        {"trained": optax.adamw(SCHEDULE, weight_decay=1e-2, mask=decay_mask), "frozen": optax.set_to_zero()}, labels
    )


OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(SCHEDULE),
    "adamw": lambda: optax.adamw(SCHEDULE, weight_decay=1e-2, mask=decay_mask),
    "nadamw": lambda: optax.nadamw(SCHEDULE, weight_decay=1e-2, mask=decay_mask),
    "lion": lambda: optax.lion(SCHEDULE, weight_decay=1e-2, mask=decay_mask),
    "lamb": lambda: optax.lamb(SCHEDULE, weight_decay=1e-2, mask=decay_mask),
    "sgd_nesterov": lambda: optax.sgd(SCHEDULE, momentum=0.9, nesterov=True),
    "rmsprop": lambda: optax.rmsprop(SCHEDULE, momentum=0.9),
    "adafactor": lambda: optax.adafactor(SCHEDULE, min_dim_size_to_factor=4),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(SCHEDULE)),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(SCHEDULE), every_k_schedule=2),
    "masked": lambda: optax.chain(optax.masked(optax.add_decayed_weights(1e-2), decay_mask), optax.adam(SCHEDULE)),
    "frozen": _frozen_head,
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(SCHEDULE), max_consecutive_errors=3),
    "zero_nans": lambda: optax.chain(optax.zero_nans(), optax.adam(SCHEDULE)),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2),
    "muon": _muon,
}


def per_device_bytes(tree: Any) -> int:
    """Bytes of ``tree`` that one device holds (its first device's shards)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            total += leaf.addressable_shards[0].data.nbytes
        else:
            total += np.asarray(leaf).nbytes
    return total


def nbytes(tree: Any) -> int:
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(tree))


def run(name: str, strategy: str = "dear", devices: int = 8, n_steps: int = 3, **options) -> dict:
    """Plain and scheduled for ``n_steps``; what the scheduled program did."""
    tx = OPTIMIZERS[name]()
    params, apply_fn = build("mlp", 0)
    opt_state = tx.init(params)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    step = steps.make_step(apply_fn, tx, mesh)
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", n_steps, 2 * devices, 1)]
    plain = (params, opt_state)
    for b in batches:
        plain = step(*plain, b)[:2]
    sched = jaxsched.schedule(step, strategy=strategy, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jaxsched.FallbackWarning)
        state = sched.init(params, opt_state)
        for b in batches:
            state, _ = sched(state, b)
        jax.block_until_ready(state)
        text = sched.lower(state, batches[0]).as_text()
    return {
        "sched": sched,
        "state": state,
        "plain": jax.device_get(plain),
        "batches": batches,
        "got": jax.device_get(sched.finalize(state)),
        "fallbacks": [str(w.message) for w in caught if issubclass(w.category, jaxsched.FallbackWarning)],
        "collectives": collectives(text),
        "param_bytes": nbytes(params),
        "param_elements": sum(np.size(x) for x in jax.tree.leaves(params)),
        "opt_bytes_plain": nbytes(opt_state),
        "opt_bytes_per_device": per_device_bytes(state.opt_state),
        "buckets": len(sched.program.buckets),
        "devices": devices,
    }
