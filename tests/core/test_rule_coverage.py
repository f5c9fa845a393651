"""Every primitive of a current training step has a per-device rule: the zoo's models, the
stacked FSDP language model, and the operations of a modern LM step (LLaMA's rotary
embedding in complex numbers, unstacking and splitting, top-k and argsort over features,
cumsum over the sequence, batched matmuls, grouped convolutions, jax.nn's custom-derivative
activations, dot_product_attention). A primitive without a rule would gather the batch; the
walk fails naming it. Then the LM step runs scheduled, equal to the plain step, without
gathering anything."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsched
from jaxsched.core.partition._control_flow import CONTROL_RULES, is_call
from jaxsched.core.partition._rules import RULES
from jaxsched.core._replay import nested_eqns
from jaxsched.zoo import models, stacked_lm


def _rotary(x):
    """LLaMA's rotary embedding: pairs of features as complex numbers, rotated."""
    pairs = jax.lax.complex(x[..., ::2], x[..., 1::2])
    freqs = jnp.exp(1j * jnp.arange(x.shape[-1] // 2) * 0.1).astype(jnp.complex64)
    turned = pairs * freqs
    return jnp.stack([jnp.real(turned), jnp.imag(turned)], -1).reshape(x.shape)


def _lm_features(h):
    """A (rows, 16) activation through the operations of a modern LM step."""
    rows = h.shape[0]
    h = _rotary(h.reshape(rows, 2, 2, 4)).reshape(h.shape)
    h = h + sum(jnp.unstack(h.reshape(rows, 4, 4), axis=1)).repeat(4, -1)
    h = jnp.concatenate(jnp.split(h, 4, axis=-1)[::-1], -1)
    h = h + jax.lax.top_k(h, 4)[0].repeat(4, -1)
    h = h + jnp.take_along_axis(h, jnp.argsort(h, -1), -1)
    h = h + jnp.cumsum(h.reshape(rows, 4, 4), axis=1).reshape(h.shape)
    h = h + jnp.einsum("bij,bjk->bik", h.reshape(-1, 4, 4), h.reshape(-1, 4, 4)).reshape(h.shape) * 0.1
    kernel = jnp.ones((4, 1, 3)) * 0.1
    grouped = jax.lax.conv_general_dilated(
        h.reshape(-1, 4, 4), kernel, (1,), "SAME", feature_group_count=4, dimension_numbers=("NCH", "OIH", "NCH")
    )
    h = h + grouped.reshape(h.shape)
    h = jax.nn.gelu(h) + jax.nn.silu(h) + jax.nn.softplus(h) + jax.nn.relu(h) - jax.nn.logsumexp(h, -1, keepdims=True)
    q = h.reshape(-1, 4, 2, 2)
    return h + jax.nn.dot_product_attention(q, q, q, is_causal=True).reshape(h.shape)


def _lm_step(tx):
    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch

        def loss_fn(p):
            return jnp.mean((jnp.tanh(_lm_features(x @ p["w"])) @ p["v"] - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return step


def _lm_inputs(seed=0, rows=16):
    rng = np.random.default_rng(seed)
    params = {
        "w": jnp.asarray(rng.normal(size=(6, 16)) * 0.3, jnp.float32),
        "v": jnp.asarray(rng.normal(size=(16, 3)) * 0.3, jnp.float32),
    }
    batch = (jnp.asarray(rng.normal(size=(rows, 6)), jnp.float32), jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32))
    return params, batch


def _zoo_step(name):
    shapes = {"mlp": ((8, 8, 1), 10), "cnn": ((8, 8, 3), 10), "transformer": ((8,), 16)}
    input_shape, outputs = shapes[name]
    params, apply_fn = models.pure(models.build(name, input_shape, outputs))
    tx = optax.adamw(1e-3)
    x = jnp.zeros((4, *input_shape), jnp.int32 if name == "transformer" else jnp.float32)
    y = jnp.zeros((4, 8) if name == "transformer" else (4,), jnp.int32)

    def step(params, opt_state, batch):
        x, y = batch

        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(apply_fn(p, x), y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), (x, y))


def _stacked_step(scan):
    mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    config = stacked_lm.StackedLM(dim=32, mlp=64, layers=2, heads=2, vocab=64, seq=8, scan=scan, remat=True)
    tx = optax.adamw(1e-3)
    params = stacked_lm.init(config, mesh)
    return stacked_lm.make_step(config, tx, mesh), (
        params,
        tx.init(params),
        stacked_lm.synthetic_batch(config, mesh, 4),
    )


def _build(name):
    """The step and its arguments, built in the test: building them at collection cost every
    pytest process (each xdist worker, the aot run) seven seconds."""
    if name == "lm_ops":
        tx = optax.adam(1e-2)
        params, batch = _lm_inputs()
        return _lm_step(tx), (params, tx.init(params), batch)
    if name.startswith("zoo_"):
        return _zoo_step(name.removeprefix("zoo_"))
    return _stacked_step(name == "stacked_lm_scan")


STEPS = ["lm_ops", *(f"zoo_{name}" for name in models.MODELS), "stacked_lm_scan", "stacked_lm_unrolled"]


@pytest.mark.parametrize("name", STEPS)
def test_every_primitive_has_a_per_device_rule(name):
    step, args = _build(name)
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    missing = sorted(
        {
            f"{e.primitive.name}"
            for e in nested_eqns(jaxpr)
            if e.primitive.name not in RULES and e.primitive.name not in CONTROL_RULES and not is_call(e)
        }
    )
    assert not missing, f"{name}: no per-device rule for {missing}"


@pytest.mark.parametrize("strategy", ["wfbp", pytest.param("dear", marks=pytest.mark.slow)])
def test_the_lm_operations_run_per_device_and_equal_the_plain_step(strategy):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = optax.sgd(0.05, momentum=0.9)  # linear in the gradient: rounding stays rounding
    step = _lm_step(tx)
    params, _ = _lm_inputs(np.random.randint(1 << 20))
    data = jax.NamedSharding(mesh, jax.P("data"))
    batches = [jax.device_put(_lm_inputs(np.random.randint(1 << 20))[1], data) for _ in range(3)]
    sched = jaxsched.schedule(step, strategy=strategy)
    state, plain = sched.init(params, tx.init(params)), (params, tx.init(params))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsched.GatherWarning)
        for batch in batches:
            *plain, plain_aux = step(*plain, batch)
            state, aux = sched(state, batch)
            np.testing.assert_allclose(float(aux["loss"]), float(plain_aux["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(sched.finalize(state)), jax.tree.leaves(tuple(plain)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
