"""jaxsched.integrations.nnx: an NNX train_step(model, optimizer, batch), scheduled, equals the plain one.

Every test runs the user's NNX step unscheduled on one copy of the objects and scheduled on
another, on fresh random batches, and compares every variable of the model and optimizer
(parameters, optimizer state and step, RNG streams, BatchNorm statistics, custom variables).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxsched
import jaxsched.integrations.nnx
from jaxsched.zoo import models
from jaxsched.demo import steps
from support.equivalence import MODEL_INPUTS, MODEL_OPTIONS, random_batches

DEVICES = 8
STEPS = 20


class Counter(nnx.Variable):
    """A non-parameter variable the model updates itself."""


class BNNet(nnx.Module):
    """Dense, BatchNorm (statistics averaged over the data axis), dropout, a call counter."""

    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32):
        self.l1 = nnx.Linear(12, 16, rngs=rngs, dtype=dtype, param_dtype=dtype)
        self.bn = nnx.BatchNorm(16, axis_name="data", rngs=rngs, dtype=dtype, param_dtype=dtype)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs, dtype=dtype, param_dtype=dtype)
        self.calls = Counter(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


def update(model, optimizer, x, y):
    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, jax.lax.pmean(grads, "data"))
    return jax.lax.pmean(loss, "data")


def nnx_shard_map_step(mesh):
    @nnx.jit
    @nnx.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())
    def train_step(model, optimizer, batch):
        return update(model, optimizer, *batch)

    return train_step


def jax_shard_map_step(mesh):
    @functools.partial(jax.jit, static_argnums=0)
    def per_device_step(graphdef, state, batch):
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()))
        def per_device(state, batch):
            m, o = nnx.merge(graphdef, state)
            loss = update(m, o, *batch)
            return nnx.state((m, o)), loss

        return per_device(state, batch)

    def train_step(model, optimizer, batch):
        graphdef, state = nnx.split((model, optimizer))
        state, loss = per_device_step(graphdef, state, batch)
        nnx.update((model, optimizer), state)
        return loss

    return train_step


def nnx_pmap_step(devices):
    @nnx.pmap(in_axes=(None, None, 0), out_axes=None, axis_name="data", devices=devices)
    def train_step(model, optimizer, batch):
        return update(model, optimizer, *batch)

    return train_step


def zoo_objects(name: str, seed: int = 0, tx: optax.GradientTransformation | None = None):
    shape, classes = MODEL_INPUTS[name]
    model = models.build(name, shape, classes, seed=seed, **MODEL_OPTIONS[name])
    return model, nnx.Optimizer(model, tx or optax.adam(1e-2), wrt=nnx.Param)


def bn_objects(seed: int = 0, dtype=jnp.float32):
    model = BNNet(nnx.Rngs(seed, dropout=seed + 1), dtype)
    for stat in (model.bn.mean, model.bn.var):  # flax keeps BatchNorm statistics in float32
        stat.set_value(stat.get_value().astype(dtype))
    return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


def bn_batches(n: int, seed: int, dtype=np.float32):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield (rng.standard_normal((2 * DEVICES, 12)).astype(dtype), rng.integers(0, 4, 2 * DEVICES).astype(np.int32))


def flat_values(*objects) -> dict:
    """Every variable of the objects by path, keys as raw data so they compare."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(objects)):
        value = var[...]
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        out[path] = np.asarray(value)
    return out


def assert_same_state(expected: dict, actual: dict, rtol: float = 1e-5):
    assert expected.keys() == actual.keys()
    for path in expected:
        np.testing.assert_allclose(
            actual[path], expected[path], rtol=rtol, atol=1e-6, err_msg=f"variable {'/'.join(map(str, path))}"
        )


def run_pair(make_objects, make_step, batches, strategy, finalize_every=None, **options):
    """Runs the plain and the scheduled step side by side; asserts every variable and every
    loss agree; returns the plain objects' values and the scheduled step."""
    plain_objects, sched_objects = make_objects(), make_objects()
    plain_step = make_step()
    sched = jaxsched.integrations.nnx.schedule(make_step(), strategy=strategy, **options)
    plain_losses, sched_losses = [], []
    for i, batch in enumerate(batches):
        plain_losses.append(float(plain_step(*plain_objects, batch)))
        sched_losses.append(float(sched(*sched_objects, batch)))
        if finalize_every and (i + 1) % finalize_every == 0:
            sched.finalize(*sched_objects)
            assert_same_state(flat_values(*plain_objects), flat_values(*sched_objects))
    sched.finalize(*sched_objects)
    plain = flat_values(*plain_objects)
    assert_same_state(plain, flat_values(*sched_objects))
    np.testing.assert_allclose(sched_losses, plain_losses, rtol=1e-5)
    return plain, sched


def _zoo_case(name, strategy):
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    batches = [steps.shard_batch(b, mesh) for b in random_batches(name, STEPS, 2 * DEVICES, seed=3)]
    _, scheduled = run_pair(lambda: zoo_objects(name), lambda: nnx_shard_map_step(mesh), batches, strategy)
    assert scheduled.scheduled.program.strategy.name == strategy


@pytest.mark.parametrize(
    "name", ["mlp", pytest.param("cnn", marks=pytest.mark.slow), pytest.param("transformer", marks=pytest.mark.slow)]
)
def test_zoo_models_match_the_unscheduled_nnx_step_with_dear(name):
    _zoo_case(name, "dear")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_zoo_models_match_the_unscheduled_nnx_step_with_wfbp(name):
    _zoo_case(name, "wfbp")


def _bn_case(style, strategy):
    """Compared in float64: in float32 the BatchNorm net's trajectories drift apart by
    reordered sums alone, to 5e-6..4e-5 relative after 20 steps depending on the CPU."""
    with jax.enable_x64(True):
        _bn_case_x64(style, strategy)


def _bn_case_x64(style, strategy):
    devices = jax.devices()[:DEVICES]
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=devices)
    if style == "nnx_pmap":
        make_step, place = (lambda: nnx_pmap_step(devices)), (lambda b: steps.split_batch(b, DEVICES))
    else:
        builder = nnx_shard_map_step if style == "nnx_shard_map" else jax_shard_map_step
        make_step, place = (lambda: builder(mesh)), (lambda b: steps.shard_batch(b, mesh))
    batches = [place(b) for b in bn_batches(STEPS, seed=5, dtype=np.float64)]
    plain, _ = run_pair(lambda: bn_objects(dtype=jnp.float64), make_step, batches, strategy)
    assert plain[(0, "l1", "kernel")].dtype == np.float64
    # the non-parameter state really moved: counters, RNG stream and BatchNorm statistics
    assert plain[(0, "calls")] == STEPS and plain[(0, "drop", "rngs", "count")] == STEPS
    assert np.any(plain[(0, "bn", "mean")] != 0)
    assert plain[(1, "step")] == STEPS


@pytest.mark.parametrize(
    "style",
    [
        "nnx_shard_map",
        pytest.param("jax_shard_map", marks=pytest.mark.slow),
        pytest.param("nnx_pmap", marks=pytest.mark.slow),
    ],
)
def test_rng_batchnorm_and_custom_variables_pass_through_dear(style):
    _bn_case(style, "dear")


@pytest.mark.slow
@pytest.mark.parametrize("style", ["nnx_shard_map", "jax_shard_map", "nnx_pmap"])
def test_rng_batchnorm_and_custom_variables_pass_through_wfbp(style):
    _bn_case(style, "wfbp")


@pytest.mark.parametrize("strategy", ["wfbp", pytest.param("auto", marks=pytest.mark.slow)])
def test_user_layout_strategies_keep_the_objects_up_to_date_after_every_step(strategy):
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    plain_objects, sched_objects = bn_objects(), bn_objects()
    plain_step = nnx_shard_map_step(mesh)
    # auto's choice depends on what it measures: keep its candidates to user-layout ones
    options = {"candidates": ("allreduce", "wfbp")} if strategy == "auto" else {}
    sched = jaxsched.integrations.nnx.schedule(
        nnx_shard_map_step(mesh), strategy=strategy, buckets=[["l1"], ["bn", "l2"]], **options
    )  # subtree prefixes
    for batch in bn_batches(4, seed=8):
        batch = steps.shard_batch(batch, mesh)
        plain_step(*plain_objects, batch)
        sched(*sched_objects, batch)
        assert_same_state(flat_values(*plain_objects), flat_values(*sched_objects))


@pytest.mark.slow
def test_dear_finalize_mid_run_then_training_goes_on():
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    batches = [steps.shard_batch(b, mesh) for b in bn_batches(6, seed=9)]
    run_pair(bn_objects, lambda: nnx_shard_map_step(mesh), batches, "dear", finalize_every=2)


@pytest.mark.slow
def test_objects_changed_between_calls_restart_from_their_values():
    """Running the plain step on the objects between scheduled calls must not be lost."""
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    batches = [steps.shard_batch(b, mesh) for b in bn_batches(6, seed=10)]
    reference, objects = bn_objects(), bn_objects()
    plain_step = nnx_shard_map_step(mesh)
    sched = jaxsched.integrations.nnx.schedule(nnx_shard_map_step(mesh), strategy="dear")
    for i, batch in enumerate(batches):
        plain_step(*reference, batch)
        if i == 3:  # the user steps the objects themselves, after bringing them up to date
            sched.finalize(*objects)
            plain_step(*objects, batch)
        else:
            sched(*objects, batch)
    sched.finalize(*objects)
    assert_same_state(flat_values(*reference), flat_values(*objects))


def test_bad_input_is_named():
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    step = nnx_shard_map_step(mesh)
    with pytest.raises(ValueError, match="strategy='dearr' is unknown"):
        jaxsched.integrations.nnx.schedule(step, strategy="dearr")
    with pytest.raises(TypeError, match="NNX train step"):
        jaxsched.integrations.nnx.schedule(42)
    sched = jaxsched.integrations.nnx.schedule(step, strategy="dear")
    model, optimizer = bn_objects()
    batch = steps.shard_batch(next(bn_batches(1, 0)), mesh)
    with pytest.raises(TypeError, match="argument 0 of the scheduled NNX step is a dict"):
        sched({"w": 1.0}, optimizer, batch)
    with pytest.raises(TypeError, match=r"takes \(model, optimizer, ..., batch\)"):
        sched(batch)

    class Empty(nnx.Module):
        def __init__(self):
            self.count = Counter(jnp.zeros(()))

    with pytest.raises(ValueError, match="hold no nnx.Param"):
        sched(Empty(), batch)
    sched(model, optimizer, batch)
    with pytest.raises(ValueError, match="another structure"):
        sched.finalize(*zoo_objects("mlp"))


def test_approx_local_on_an_nnx_step_equals_it_on_the_functional_step():
    """nnx.shard_map checks vma, so JAX reduces gradients in backward and the user's pmean is
    a sum of identical values: approx's local update, replayed on one device's unreduced
    gradient, must treat it as the identity it means (not refuse, not sum local grads)."""
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", 5, 2 * DEVICES, seed=6)]
    # Under check_vma the NNX step's gradient is the *sum* of the devices' gradients (JAX sums
    # in backward; the pmean of that invariant sum keeps it), the functional step's the mean:
    # SGD with an 8x learning rate on the mean is the same algorithm, in both approx paths.
    model, optimizer = zoo_objects("mlp", tx=optax.sgd(0.1, momentum=0.9))
    params, apply_fn = models.pure(zoo_objects("mlp")[0])
    tx = optax.sgd(0.1 * DEVICES, momentum=0.9)
    functional = jaxsched.schedule(
        steps.make_step(apply_fn, tx, mesh), strategy="approx", approx_method="local", staleness=1
    )
    state = functional.init(params, tx.init(params))
    sched = jaxsched.integrations.nnx.schedule(
        nnx_shard_map_step(mesh), strategy="approx", approx_method="local", staleness=1
    )
    for batch in batches:
        state, _ = functional(state, batch)
        sched(model, optimizer, batch)
    sched.finalize(model, optimizer)
    expected = jax.tree.leaves(functional.finalize(state)[0])
    actual = jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert len(expected) == len(actual)
    for a, b in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
