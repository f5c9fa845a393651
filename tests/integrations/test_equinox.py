"""Equinox steps as Equinox writes them: ``eqx.filter_jit``, ``eqx.filter_shard`` placement,
models whose leaves include functions and Python scalars. Scheduled, each equals the plain
``filter_jit`` step on fresh random batches, and every returned leaf has the plain step's
shape, dtype and sharding; non-array leaves come back as the same objects."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsched

EXACT = ["wfbp", "dear", pytest.param("allreduce", marks=pytest.mark.slow)]


def _mesh():
    return jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))


def _assert_same(got, want):
    """Same structure (static leaves included), and per array leaf the same values, shape,
    dtype and sharding."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    dynamic_got, static_got = eqx.partition(got, eqx.is_array)
    dynamic_want, static_want = eqx.partition(want, eqx.is_array)
    assert eqx.tree_equal(static_got, static_want)
    for a, b in zip(jax.tree.leaves(dynamic_got), jax.tree.leaves(dynamic_want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def _example_step(optim):
    """Equinox's data-parallel example: the sharding is an argument, everything is placed
    with filter_shard inside, and the step returns the model and the optimizer state only."""

    def compute_loss(model, x, y):
        return jnp.mean((y - jax.vmap(model)(x)) ** 2)

    @eqx.filter_jit
    def train_step(model, opt_state, x, y, sharding):
        replicated = jax.NamedSharding(sharding.mesh, jax.P())
        model, opt_state = eqx.filter_shard((model, opt_state), replicated)
        x, y = eqx.filter_shard((x, y), sharding)
        grads = eqx.filter_grad(compute_loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return eqx.filter_shard((model, opt_state), replicated)

    return train_step


def _batches(sharding, n, rows=32, seed=0):
    rng = np.random.default_rng(seed)
    return [
        eqx.filter_shard(
            (
                jnp.asarray(rng.normal(size=(rows, 4)), jnp.float32),
                jnp.asarray(rng.normal(size=(rows, 2)), jnp.float32),
            ),
            sharding,
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("strategy", EXACT)
def test_equinoxs_data_parallel_example_as_written(strategy):
    mesh = _mesh()
    sharding, replicated = jax.NamedSharding(mesh, jax.P("batch")), jax.NamedSharding(mesh, jax.P())
    optim = optax.adam(1e-2)
    train_step = _example_step(optim)

    def fresh():
        model = eqx.nn.MLP(4, 2, 16, 2, activation=jax.nn.tanh, key=jax.random.key(int(np.random.randint(1 << 30))))
        return eqx.filter_shard((model, optim.init(eqx.filter(model, eqx.is_array))), replicated)

    model, opt_state = fresh()
    plain = (model, opt_state)
    sched = jaxsched.schedule(train_step, strategy=strategy)
    state = sched.init(*jax.tree.map(lambda a: a.copy() if eqx.is_array(a) else a, (model, opt_state)))
    for x, y in _batches(sharding, 3, seed=np.random.randint(1 << 30)):
        plain = train_step(*plain, x, y, sharding)
        state = sched(state, x, y, sharding)  # the step returns its state alone: so does sched
    got = sched.finalize(state)
    _assert_same(got, plain)
    assert got[0].activation is jax.nn.tanh and got[0].final_activation is plain[0].final_activation


class Scaled(eqx.Module):
    """A model with leaves filter_jit keeps static: a lambda and a Python float (not fields
    declared static), beside a layer with its own activation functions."""

    mlp: eqx.nn.MLP
    squash: object
    scale: float

    def __call__(self, x):
        return self.scale * self.squash(self.mlp(x))


@pytest.mark.parametrize("strategy", EXACT)
def test_a_model_with_function_and_scalar_leaves_and_an_aux(strategy):
    mesh = _mesh()
    sharding = jax.NamedSharding(mesh, jax.P("batch"))
    optim = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, momentum=0.9))

    @eqx.filter_jit
    def train_step(model, opt_state, batch):
        x, y = batch

        def loss_fn(model):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, {"loss": loss, "scale": model.scale}

    squash = lambda h: jnp.sin(h)  # noqa: E731
    key = jax.random.key(int(np.random.randint(1 << 30)))
    model = Scaled(eqx.nn.MLP(4, 2, 8, 1, key=key), squash, 0.5)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    sched = jaxsched.schedule(train_step, strategy=strategy)
    state = sched.init(model, opt_state)
    plain = (model, opt_state)
    for batch in _batches(sharding, 3, seed=np.random.randint(1 << 30)):
        *plain, plain_aux = train_step(*plain, batch)
        state, aux = sched(state, batch)
        np.testing.assert_allclose(float(aux["loss"]), float(plain_aux["loss"]), rtol=1e-5)
        assert aux["scale"] == 0.5 and type(aux["scale"]) is float  # static, as filter_jit returns it
    got = sched.finalize(state)
    _assert_same(got, tuple(plain))
    assert got[0].squash is squash and got[0].scale == 0.5


def test_verify_and_a_changed_static_argument():
    """``verify`` runs the Equinox step; a different sharding argument is a new program, as
    it is a new trace under filter_jit."""
    mesh = _mesh()
    sharding, replicated = jax.NamedSharding(mesh, jax.P("batch")), jax.NamedSharding(mesh, jax.P())
    optim = optax.sgd(0.1)
    train_step = _example_step(optim)
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    model, opt_state = eqx.filter_shard((model, optim.init(eqx.filter(model, eqx.is_array))), replicated)
    sched = jaxsched.schedule(train_step, strategy="dear")
    state = sched.init(model, opt_state)
    batches = [(x, y, sharding) for x, y in _batches(sharding, 3)]
    report = sched.verify(state, batches, steps=3)
    assert report.ok, report
    state = sched(state, *batches[0])
    other = jax.NamedSharding(mesh, jax.P("batch", None))  # the same layout, spelled otherwise
    sched(state, *batches[1][:2], other)
    assert sched.num_programs == 2
