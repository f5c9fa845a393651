"""Shared helpers: run the plain step and a scheduled one side by side on fresh random data."""

from __future__ import annotations

import jax
import numpy as np
import optax

import jaxsched
from jaxsched.zoo import models
from jaxsched.demo import steps

MODEL_INPUTS = {"mlp": ((8, 8, 1), 10), "cnn": ((8, 8, 1), 10), "transformer": ((8,), 16)}
MODEL_OPTIONS = {
    "mlp": {"hidden": (13, 7)},
    "cnn": {"channels": 4, "blocks": 1},
    "transformer": {"dim": 16, "heads": 2, "layers": 1},
}


def random_batches(model: str, n_steps: int, batch: int, seed: int):
    shape, classes = MODEL_INPUTS[model]
    rng = np.random.default_rng(seed)
    for _ in range(n_steps):
        if model == "transformer":
            x = rng.integers(0, classes, size=(batch, *shape)).astype(np.int32)
            y = rng.integers(0, classes, size=(batch, *shape)).astype(np.int32)
        else:
            x = rng.standard_normal((batch, *shape)).astype(np.float32)
            y = rng.integers(0, classes, size=batch).astype(np.int32)
        yield x, y


def build(model: str, seed: int):
    shape, classes = MODEL_INPUTS[model]
    return models.pure(models.build(model, shape, classes, seed=seed, **MODEL_OPTIONS[model]))


def run_both(
    model: str,
    tx: optax.GradientTransformation,
    strategy: str,
    devices: int,
    n_steps: int = 20,
    api: str = "shard_map",
    seed: int = 0,
    buckets=None,
    batch_per_device: int = 2,
    **options,
):
    """Returns ((plain params, plain opt), (scheduled params, opt), plain auxes, scheduled auxes)."""
    params, apply_fn = build(model, seed)
    opt_state = tx.init(params)
    devs = jax.devices()[:devices]
    if api == "shard_map":
        mesh = jax.make_mesh((devices,), ("data",), devices=devs)
        step = steps.make_step(apply_fn, tx, mesh)
        place = lambda b: steps.shard_batch(b, mesh)
        start = (params, opt_state)
    else:
        step = steps.make_pmap_step(apply_fn, tx, devices=devs)
        place = lambda b: steps.split_batch(b, devices)
        start = steps.replicate((params, opt_state), devices)
    batches = [place(b) for b in random_batches(model, n_steps, batch_per_device * devices, seed + 1)]

    plain = start
    plain_aux = []
    for b in batches:
        p, o, aux = step(*plain, b)
        plain = (p, o)
        plain_aux.append(jax.device_get(jax.block_until_ready(aux)))

    sched = jaxsched.schedule(step, strategy=strategy, buckets=buckets, **options)
    state = sched.init(*start)
    sched_aux = []
    for b in batches:
        state, aux = sched(state, b)
        sched_aux.append(jax.device_get(jax.block_until_ready(aux)))
    return plain, sched.finalize(state), plain_aux, sched_aux, sched


def assert_placed_like(plain, scheduled):
    """Every leaf the plain step returns on the mesh is a ``jax.Array`` there in ``scheduled``
    too, sharded alike (not a host array)."""
    for x, y in zip(jax.tree.leaves(plain), jax.tree.leaves(scheduled)):
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            assert isinstance(y, jax.Array), (type(y), x.sharding)
            assert y.sharding.is_equivalent_to(x.sharding, x.ndim), (y.sharding, x.sharding)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    sa, sb = jax.tree.structure(a), jax.tree.structure(b)
    assert sa == sb, (sa, sb)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
