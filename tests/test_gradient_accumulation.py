"""Gradient accumulation as trainers write it, in ``jax.jit`` steps: MaxText's batch reshaped
to ``(microbatches, rows, ...)`` and scanned, a Python loop over microbatches, and
``optax.MultiSteps``. Each is compared with the plain step on fresh random batches under
every exact strategy; the batch is never gathered (no ``GatherWarning``), and the gradient
summed over a scan of microbatches is reduced once, after the loop."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsched
from jaxsched.core._replay import nested_eqns

EXACT = ["wfbp", "dear", pytest.param("allreduce", marks=pytest.mark.slow)]


def _mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _params(rng):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)  # noqa: E731
    return {"w1": normal(6, 16), "b1": jnp.zeros(16), "w2": normal(16, 3)}


def _batches(mesh, rng, rows, n=3):
    data = jax.NamedSharding(mesh, jax.P("data"))
    return [
        jax.device_put(
            (
                jnp.asarray(rng.normal(size=(rows, 6)), jnp.float32),
                jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32),
            ),
            data,
        )
        for _ in range(n)
    ]


def _scanned_step(tx, microbatches):
    """MaxText's train_step: the batch reshaped to (microbatches, rows, ...), a scan whose
    carry sums the loss and the gradients, the per-microbatch losses stacked as its ys."""

    @jax.jit
    def step(params, opt_state, batch):
        split = jax.tree.map(lambda a: a.reshape((microbatches, a.shape[0] // microbatches) + a.shape[1:]), batch)

        def accumulate(carry, data):
            loss, grads = jax.value_and_grad(_loss)(params, *data)
            return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads)), loss

        init = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), losses = jax.lax.scan(accumulate, init, split)
        grads = jax.tree.map(lambda g: g / microbatches, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss / microbatches, "losses": losses}

    return step


def _looped_step(tx, microbatches):
    """A Python loop over microbatches sliced from the reshaped batch."""

    @jax.jit
    def step(params, opt_state, batch):
        x, y = (a.reshape((microbatches, a.shape[0] // microbatches) + a.shape[1:]) for a in batch)
        grads, total = jax.tree.map(jnp.zeros_like, params), 0.0
        for i in range(microbatches):
            loss, g = jax.value_and_grad(_loss)(params, x[i], y[i])
            grads, total = jax.tree.map(jnp.add, grads, g), total + loss
        updates, opt_state = tx.update(jax.tree.map(lambda g: g / microbatches, grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": total / microbatches}

    return step


def _run(step, tx, mesh, rows, strategy, seed):
    rng = np.random.default_rng(seed)
    params = _params(rng)
    batches = _batches(mesh, rng, rows)
    sched = jaxsched.schedule(step, strategy=strategy)
    state = sched.init(jax.tree.map(jnp.copy, params), tx.init(params))
    plain = (params, tx.init(params))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsched.GatherWarning)
        for batch in batches:
            *plain, plain_aux = step(*plain, batch)
            state, aux = sched(state, batch)
            for a, b in zip(jax.tree.leaves(aux), jax.tree.leaves(plain_aux), strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    got = sched.finalize(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(tuple(plain)), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    return sched


@pytest.mark.parametrize("strategy", EXACT)
@pytest.mark.parametrize(
    "microbatches, rows",
    [(4, 64), (16, 256), pytest.param(8, 64, marks=pytest.mark.slow), pytest.param(3, 48, marks=pytest.mark.slow)],
    ids=lambda v: str(v),
)
def test_microbatches_scanned_as_maxtext_writes_them(strategy, microbatches, rows):
    """Fewer microbatches than devices (each split over the devices from a gathered batch),
    as many, and more (each device's whole microbatches swapped for rows by an all-to-all)."""
    tx = optax.adam(1e-2)
    sched = _run(_scanned_step(tx, microbatches), tx, _mesh(), rows, strategy, seed=np.random.randint(1 << 30))
    if strategy != "allreduce":  # the gradient sums are reduced after the loop, not in it
        body = sched.program.captured.body
        loops = [e for e in body.eqns if e.primitive.name == "scan"]
        inside = [e for loop in loops for e in nested_eqns(loop.params["jaxpr"].jaxpr)]
        reduced = [e.invars[0].aval.shape for e in inside if e.primitive.name in ("psum", "reduce_scatter")]
        assert all(shape == () for shape in reduced), reduced  # the per-microbatch loss at most


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_a_python_loop_over_microbatches(strategy):
    tx = optax.sgd(0.05, momentum=0.9)
    _run(_looped_step(tx, 4), tx, _mesh(), 64, strategy, seed=np.random.randint(1 << 30))


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_optax_multisteps(strategy):
    """optax.MultiSteps accumulates the reduced gradients in its state and applies them every
    k-th step: the mini-step count, the accumulator and the skipped updates are the plain step's."""
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(_loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    _run(step, tx, _mesh(), 32, strategy, seed=np.random.randint(1 << 30))
