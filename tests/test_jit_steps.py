"""`jax.jit` data-parallel steps, written as the JAX and Flax docs teach them (parameters
replicated, the batch placed with NamedSharding, no shard_map): each exact strategy equals the
plain jit step on fresh random inputs (rtol 1e-5), or the step is refused by name."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxsched
import support.jit_steps as js
from support.toolchains import needs_gpu, needs_tpu
from support import SUPPORT_DIR

EXACT = {"allreduce": {}, "wfbp": {}, "dear": {}, "approx": {"staleness": 0}}


def _mesh(shape=(8,), names=("data",), explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape), devices=jax.devices()[:n])


def _copy(tree):
    return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else np.array(a), tree)


def _close(got, want, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        if jnp.issubdtype(jnp.result_type(b), jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        if jnp.issubdtype(jnp.result_type(b), jnp.inexact):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _run_trees(step, params, opt_state, batches, strategy, **options):
    """Plain and scheduled side by side on a (params, opt_state, batch) step."""
    plain, plain_aux = (_copy(params), _copy(opt_state)), []
    for b in batches:
        *plain, aux = step(*plain, b)
        plain_aux.append(jax.device_get(aux))
    sched = jaxsched.schedule(step, strategy=strategy, **options)
    state, sched_aux = sched.init(_copy(params), _copy(opt_state)), []
    for b in batches:
        state, aux = sched(state, b)
        sched_aux.append(jax.device_get(jax.block_until_ready(aux)))
    _close(sched.finalize(state), tuple(plain))
    _close(sched_aux, plain_aux)
    return sched


def _run_state(step, state, batches, strategy, **options):
    """Plain and scheduled side by side on a step(state, batch) -> (state, aux)."""
    plain, plain_aux = _copy(state), []
    for b in batches:
        plain, aux = step(plain, b)
        plain_aux.append(jax.device_get(aux))
    sched = jaxsched.schedule(step, strategy=strategy, **options)
    sstate, sched_aux = sched.init(_copy(state)), []
    for b in batches:
        sstate, aux = sched(sstate, b)
        sched_aux.append(jax.device_get(jax.block_until_ready(aux)))
    _close(sched.finalize(sstate), plain)
    _close(sched_aux, plain_aux)
    return sched


# -- equivalence -------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", list(EXACT))
def test_mlp_with_adam_equals_the_plain_jit_step(strategy):
    mesh, tx = _mesh(), optax.adam(1e-2)
    params = js.mlp_params(0)
    batches = [js.place(mesh, b) for b in js.mlp_batches(1, 4, 16)]
    sched = _run_trees(js.mlp_step(tx), params, tx.init(params), batches, strategy, **EXACT[strategy])
    captured = sched.program.captured
    assert captured.kind == "jit" and captured.axis_name == "data" and captured.axis_size == 8


def test_allreduce_runs_the_jit_step_as_written_bit_for_bit():
    mesh, tx = _mesh(), optax.adam(1e-2)
    params = js.mlp_params(3)
    batches = [js.place(mesh, b) for b in js.mlp_batches(4, 3, 16)]
    step = js.mlp_step(tx)
    plain = (_copy(params), tx.init(params))
    sched = jaxsched.schedule(step, strategy="allreduce")
    state = sched.init(_copy(params), tx.init(params))
    for b in batches:
        *plain, aux = step(*plain, b)
        state, saux = sched(state, b)
    for a, b in zip(jax.tree.leaves(sched.finalize(state)), jax.tree.leaves(tuple(plain))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_gradient_sums_are_the_reductions_the_strategies_schedule():
    mesh, tx = _mesh(), optax.sgd(0.1)
    params = js.mlp_params(0)
    sched = jaxsched.schedule(js.mlp_step(tx), strategy="wfbp")
    state = sched.init(params, tx.init(params))
    sched(state, js.place(mesh, js.mlp_batches(1, 1, 16)[0]))
    analysis = sched.program.planned.analysis
    # one psum per parameter gradient, none for the loss (aux) or inside forward
    assert len(analysis.reductions) == 3
    assert sorted(r.operand.aval.shape for r in analysis.reductions) == [(6, 16), (16,), (16, 3)]
    assert analysis.forward_collectives == ()


@pytest.mark.parametrize(
    "strategy",
    ["dear", pytest.param("wfbp", marks=pytest.mark.slow), pytest.param("allreduce", marks=pytest.mark.slow)],
)
def test_cnn_with_global_batch_norm_dropout_and_label_smoothing(strategy):
    mesh = _mesh()
    state, model, tx = js.cnn_state(0)
    batches = [js.place(mesh, b) for b in js.cnn_batches(2, 3, 16)]
    sched = _run_state(js.cnn_state_step(model, tx), state, batches, strategy)
    # batch-norm statistics are reduced where the step computes them (forward), not scheduled
    inner = sched.program.planned.analysis
    assert inner.forward_collectives
    assert sched.program.captured.gathers == ()


@pytest.mark.parametrize(
    "strategy",
    [
        "dear",
        pytest.param("wfbp", marks=pytest.mark.slow),
        pytest.param("allreduce", marks=pytest.mark.slow),
        pytest.param("approx", marks=pytest.mark.slow),
    ],
)
def test_transformer_lm_with_masks_global_count_smoothing_clipping_scan_and_remat(strategy):
    mesh = _mesh()
    model, params, tx = js.lm_setup(0)
    batches = [js.place(mesh, b) for b in js.lm_batches(1, 3, 16)]
    sched = _run_trees(js.lm_step(model, tx), params, tx.init(params), batches, strategy, **EXACT[strategy])
    assert sched.program.fallbacks == [] and sched.program.captured.gathers == ()
    from jaxsched.core._replay import nested_eqns

    kept = {e.primitive.name for e in nested_eqns(sched.program.captured.body)}
    assert {"scan", "remat2"} <= kept  # the per-device body still loops and rematerializes


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_flax_train_state_step(strategy):
    mesh = _mesh()
    model = js.Cnn()
    variables = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 2)), train=False)
    # eps well above float32 rounding of the gradients: adam divides a near-zero gradient by
    # its own root mean square, which turns reassociation noise into differences of order lr
    tx = optax.adamw(1e-2, eps=1e-4, weight_decay=0.05)

    @jax.jit
    def step(state, batch):
        x, y = batch

        def loss_fn(params):
            logits = state.apply_fn({"params": params, "batch_stats": variables["batch_stats"]}, x, train=False)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)
    batches = [js.place(mesh, b) for b in js.cnn_batches(3, 3, 16)]
    sched = _run_state(step, state, batches, strategy)
    assert type(sched.finalize(sched.init(state))) is TrainState


def _nnx_model():
    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(6, 16, rngs=rngs)
            self.head = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.tanh(self.hidden(x)))

    model = Mlp(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_nnx_step_as_the_flax_guide_writes_it(strategy):
    mesh = _mesh(explicit=True)  # jax.make_mesh's default axis type

    @nnx.jit
    def train_step(model, optimizer, x, y):
        x = jax.sharding.reshard(x, P("data"))

        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with jax.set_mesh(mesh):
        batches = [js.place(mesh, b) for b in js.mlp_batches(5, 3, 16)]
        model, optimizer = _nnx_model()
        sched_model, sched_optimizer = _nnx_model()
        sched = jaxsched.nnx.schedule(train_step, strategy=strategy)
        for x, y in batches:
            loss = train_step(model, optimizer, x, y)
            sched_loss = sched(sched_model, sched_optimizer, x, y)
            np.testing.assert_allclose(float(sched_loss), float(loss), rtol=1e-5)
        sched.finalize(sched_model, sched_optimizer)
    _close(nnx.state(sched_model, nnx.Param), nnx.state(model, nnx.Param))
    assert sched.scheduled.program.captured.kind == "jit"


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_explicit_axes_mesh_set_with_set_mesh(strategy):
    mesh, tx = _mesh(explicit=True), optax.adam(1e-2)
    with jax.set_mesh(mesh):
        params = js.replicated(mesh, js.mlp_params(1))
        batches = [js.place(mesh, b) for b in js.mlp_batches(2, 3, 16)]
        _run_trees(js.mlp_step(tx), params, tx.init(params), batches, strategy)


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_two_data_axes(strategy):
    mesh, tx = _mesh((2, 4), ("dcn", "ici")), optax.adam(1e-2)
    params = js.mlp_params(2)
    batches = [js.place(mesh, b, P(("dcn", "ici"))) for b in js.mlp_batches(3, 3, 16)]
    sched = _run_trees(js.mlp_step(tx), params, tx.init(params), batches, strategy)
    assert sched.program.captured.axis_name == ("dcn", "ici")


def test_in_shardings_given_to_jit_place_host_arrays():
    mesh, tx = _mesh(), optax.sgd(0.1, momentum=0.9)
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = js.mlp_params(4)
    step = jax.jit(js.mlp_step(tx).__wrapped__, in_shardings=(rep, rep, data))
    batches = js.mlp_batches(6, 3, 16)  # NumPy arrays: jit places them
    sched = _run_trees(step, params, tx.init(params), batches, "dear")
    assert sched.program.captured.axis_name == "data"


def test_one_device_without_a_mesh():
    tx = optax.adam(1e-2)
    params = js.mlp_params(5)
    batches = js.mlp_batches(7, 3, 8)
    sched = _run_trees(js.mlp_step(tx), params, tx.init(params), batches, "dear")
    assert sched.program.captured.axis_size == 1


# -- step forms ----------------------------------------------------------------------------
def test_a_step_that_returns_only_its_state():
    """JAX's SPMD MNIST example: update(params, batch) -> params, SGD written inline."""
    mesh = _mesh()

    @jax.jit
    def update(params, batch):
        x, y = batch
        grads = jax.grad(js.mlp_loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = js.mlp_params(6)
    batches = [js.place(mesh, b) for b in js.mlp_batches(8, 3, 16)]
    plain = _copy(params)
    sched = jaxsched.schedule(update, strategy="wfbp")
    state = sched.init(_copy(params))
    for b in batches:
        plain = update(plain, b)
        state = sched(state, b)  # the state alone, as the step returns it
    _close(sched.finalize(state), plain)


def test_extra_inputs_between_the_state_and_the_batch_pass_through():
    """big_vision's update_fn(train_state, rng, batch): a replicated key before the batch."""
    mesh = _mesh()
    tx = optax.sgd(0.1)

    @jax.jit
    def update_fn(train_state, rng, batch):
        x, y = batch
        mask = jax.random.bernoulli(rng, 0.8, x.shape)  # dropout on the inputs, global bits
        loss, grads = jax.value_and_grad(js.mlp_loss)(train_state["params"], x * mask / 0.8, y)
        updates, opt = tx.update(grads, train_state["opt"], train_state["params"])
        return {"params": optax.apply_updates(train_state["params"], updates), "opt": opt}, {"loss": loss}

    params = js.mlp_params(7)
    state = {"params": params, "opt": tx.init(params)}
    batches = [js.place(mesh, b) for b in js.mlp_batches(9, 3, 16)]
    keys = [jax.random.key(i) for i in range(3)]
    plain = _copy(state)
    sched = jaxsched.schedule(update_fn, strategy="dear")
    sstate = sched.init(_copy(state))
    for key, b in zip(keys, batches):
        plain, aux = update_fn(plain, key, b)
        sstate, saux = sched(sstate, key, b)
        _close(saux, aux)
    _close(sched.finalize(sstate), plain)
    with pytest.raises(TypeError, match=r"got 1 input\(s\) after the state; the step takes 2"):
        sched(sstate, batches[0])


def test_random_draws_have_the_bits_of_the_plain_step():
    """Dropout on batch-sharded activations draws, per device, the global draw's block."""
    mesh, tx = _mesh(), optax.sgd(0.1)

    @jax.jit
    def step(params, opt_state, batch):
        x, y, key = batch

        def loss(p):
            h = jnp.tanh(x @ p["w1"] + p["b1"])
            keep = jax.random.bernoulli(key, 0.5, h.shape)
            return optax.softmax_cross_entropy_with_integer_labels((h * keep) @ p["w2"], y).mean()

        l, g = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": l}

    params = js.mlp_params(8)
    batches = [js.place(mesh, b) + (jax.random.key(i),) for i, b in enumerate(js.mlp_batches(3, 3, 16))]
    sched = _run_trees(step, params, tx.init(params), batches, "dear")
    # each device hashes only its block's counters (2 of the 16 rows), as XLA's partitioner does
    hashes = [e for e in sched.program.captured.body.eqns if e.primitive.name == "threefry2x32"]
    assert hashes and all(e.outvars[0].aval.shape == (2, 16) for e in hashes)


def test_positions_along_the_batch_are_this_blocks_positions():
    mesh, tx = _mesh(), optax.sgd(0.1)

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch
        weight = 1.0 + jnp.arange(x.shape[0], dtype=jnp.float32) / x.shape[0]  # iota over the batch

        def loss(p):
            logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
            per = weight * optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jnp.mean(per), per

        (l, per), g = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": l, "per_example": per}

    params = js.mlp_params(13)
    batches = [js.place(mesh, b) for b in js.mlp_batches(14, 2, 16)]
    sched = _run_trees(step, params, tx.init(params), batches, "wfbp")
    assert sched.program.planned.aux_specs == (P(), P("data"))  # the per-example aux stays split
    iotas = [e for e in sched.program.captured.body.eqns if e.primitive.name == "iota"]
    assert iotas and all(e.outvars[0].aval.shape == (2,) for e in iotas)  # this block's positions


def test_donated_inputs_are_scheduled_and_verified():
    mesh, tx = _mesh(), optax.adam(1e-2)
    params = js.mlp_params(9)
    step = js.mlp_step(tx, donate=True)
    batches = [js.place(mesh, b) for b in js.mlp_batches(10, 3, 16)]
    _run_trees(step, params, tx.init(params), batches, "dear")
    sched = jaxsched.schedule(step, strategy="dear")
    report = sched.verify(sched.init(_copy(params), tx.init(params)), batches, steps=3)
    assert report.ok, str(report)


# -- operations that mix examples across the batch ----------------------------------------------
def test_mixup_roll_sort_top_k_and_cumsum_over_the_batch_are_gathered_exactly():
    mesh, tx = _mesh(), optax.sgd(0.1)

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch
        mixed = 0.7 * x + 0.3 * jnp.roll(x, 1, axis=0)

        def loss(p):
            logits = jnp.tanh(mixed @ p["w1"] + p["b1"]) @ p["w2"]
            per = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            hardest = jax.lax.top_k(per, 4)[0].mean()
            return per.mean() + 0.1 * hardest + 0.01 * jnp.cumsum(jnp.sort(per))[-1]

        l, g = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": l}

    params = js.mlp_params(10)
    batches = [js.place(mesh, b) for b in js.mlp_batches(11, 3, 16)]
    with pytest.warns(jaxsched.GatherWarning, match=r"test_jit_steps.py:\d+"):
        sched = _run_trees(step, params, tx.init(params), batches, "dear")
    gathered = {name for name, _ in sched.program.captured.gathers}
    assert {"slice", "top_k", "sort"} <= gathered


def test_rows_sorted_over_the_batch_then_labels_taken_along_them_equal_the_plain_step():
    """The sort runs on the gathered batch; ``take_along_axis`` then pairs those (now whole)
    rows with each device's labels: the rows are cut back to the device's block, not bound
    whole against local labels (a gather whose batching dimensions disagreed)."""
    mesh, tx = _mesh(), optax.sgd(0.1)

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch
        hardest_first = jnp.sort(x, axis=0)

        def loss(p):
            logits = jnp.tanh(hardest_first @ p["w1"] + p["b1"]) @ p["w2"]
            picked = jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)
            return -picked.mean()

        l, g = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": l}

    params = js.mlp_params(12)
    batches = [js.place(mesh, b) for b in js.mlp_batches(13, 3, 16)]
    with pytest.warns(jaxsched.GatherWarning, match="sort"):
        _run_trees(step, params, tx.init(params), batches, "wfbp")


# -- refusals ----------------------------------------------------------------------------------
def test_an_unsharded_batch_on_a_mesh_is_refused():
    mesh, tx = _mesh(), optax.sgd(0.1)
    params = js.replicated(mesh, js.mlp_params(0))
    sched = jaxsched.schedule(js.mlp_step(tx), strategy="wfbp")
    state = sched.init(params, tx.init(params))
    with pytest.raises(jaxsched.UnsupportedStepError, match=r"no batch leaf is sharded over the mesh"):
        sched(state, js.place(mesh, js.mlp_batches(0, 1, 16)[0], P()))


@pytest.mark.parametrize("strategy", ["wfbp", "dear", pytest.param("allreduce", marks=pytest.mark.slow)])
def test_a_shard_map_over_the_data_axis_inside_a_jit_step(strategy):
    """big_vision's train.py mixes its batch in a jax.shard_map inside the jit step: the body
    is per device already and runs as written on each device's rows (a rolled copy of the
    local rows, a mixing weight from a key folded with the device's index)."""
    mesh, tx = _mesh(), optax.sgd(0.1, momentum=0.9)

    def mixup(x, key):
        a = jax.random.beta(jax.random.fold_in(key, jax.lax.axis_index("data")), 0.2, 0.2)
        return a * x + (1 - a) * jnp.roll(x, 1, 0)

    @jax.jit
    def step(params, opt_state, batch):
        x, y, key = batch
        x = jax.shard_map(mixup, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))(x, key)
        l, g = jax.value_and_grad(js.mlp_loss)(params, x, y)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": l}

    params = js.replicated(mesh, js.mlp_params(np.random.randint(1 << 20)))
    seed = np.random.randint(1 << 20)
    batches = [(*js.place(mesh, b), jax.random.key(seed + k)) for k, b in enumerate(js.mlp_batches(seed, 3, 16))]
    _run_trees(step, params, tx.init(params), batches, strategy)


def test_a_shard_map_over_a_model_axis_inside_a_jit_step_is_refused_naming_the_line():
    mesh, tx = _mesh((4, 2), ("data", "model")), optax.sgd(0.1)

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch
        x = jax.shard_map(lambda v: v * 2, mesh=mesh, in_specs=P("model"), out_specs=P("model"))(x)
        l, g = jax.value_and_grad(js.mlp_loss)(params, x, y)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": l}

    params = js.mlp_params(0)
    sched = jaxsched.schedule(step, strategy="wfbp")
    state = sched.init(params, tx.init(params))
    with pytest.raises(
        jaxsched.UnsupportedStepError,
        match=r"cannot run shard_map at .*test_jit_steps.py:\d+.*manual over \['data', 'model'\]",
    ):
        sched(state, js.place(mesh, js.mlp_batches(0, 1, 16)[0]))


def test_batches_sharded_over_different_axes_are_refused():
    mesh, tx = _mesh((2, 4), ("a", "b")), optax.sgd(0.1)
    params = js.mlp_params(0)
    x, y = js.mlp_batches(0, 1, 16)[0]
    sched = jaxsched.schedule(js.mlp_step(tx), strategy="wfbp")
    state = sched.init(params, tx.init(params))
    with pytest.raises(jaxsched.UnsupportedStepError, match=r"sharded over \('b',\), other batch"):
        sched(state, (js.place(mesh, x, P("a")), js.place(mesh, y, P("b"))))


# -- over shapes -------------------------------------------------------------------------------
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    devices=st.sampled_from([1, 2, 4, 8]),
    rows_per_device=st.integers(1, 3),
    reduce_axis=st.sampled_from([0, 1, None]),
    seed=st.integers(0, 2**16),
)
def test_reductions_over_any_dimension_of_any_batch_size(devices, rows_per_device, reduce_axis, seed):
    """A loss that reduces the batch over axis 0, axis 1 (features, then the batch) or all
    at once, with a per-example weight normalised by its global sum."""
    mesh, tx = _mesh((devices,)), optax.adam(1e-2)
    rows = devices * rows_per_device

    @jax.jit
    def step(params, opt_state, batch):
        x, y, w = batch

        def loss(p):
            logits = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
            per = optax.softmax_cross_entropy_with_integer_labels(logits, y) * w
            if reduce_axis is None:
                return jnp.sum(per) / jnp.sum(w)
            grid = (logits * w[:, None]).sum(axis=reduce_axis)
            return jnp.sum(per) / jnp.sum(w) + 0.01 * jnp.sum(grid**2)

        l, g = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": l}

    rng = np.random.default_rng(seed)
    params = js.mlp_params(seed % 7)
    batches = [
        js.place(mesh, (x, y, rng.uniform(0.1, 1.0, rows).astype(np.float32))) for x, y in js.mlp_batches(seed, 2, rows)
    ]
    _run_trees(step, params, tx.init(params), batches, "dear")


# -- everything else works on these steps --------------------------------------------------------
@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_the_jit_step_schedules_as_its_shard_map_twin(strategy):
    """Same model, same optimizer, written both ways: the same buckets, the same gradient
    reductions, the same numbers, compression included."""
    from jaxsched.runtime import compress
    from jaxsched.demo import steps
    from support.equivalence import build, random_batches

    mesh, tx = _mesh(), optax.adam(1e-2)
    params, apply_fn = build("mlp", 0)
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", 3, 16, 1)]
    results = {}
    for form, step in (("jit", steps.make_jit_step(apply_fn, tx)), ("shard_map", steps.make_step(apply_fn, tx, mesh))):
        sched = jaxsched.schedule(
            step, strategy=strategy, buckets=2000, compression=compress.TopK(0.3) if strategy == "wfbp" else None
        )
        state = sched.init(_copy(params), tx.init(params))
        for b in batches:
            state, aux = sched(state, b)
        planned = sched.program.planned
        results[form] = (
            sched.finalize(state),
            jax.device_get(aux),
            len(planned.buckets),
            len(planned.analysis.reductions),
        )
    jit, twin = results["jit"], results["shard_map"]
    assert jit[2:] == twin[2:]
    _close(jit[0], twin[0])
    _close(jit[1], twin[1])


def test_checkpoint_round_trip_of_a_jit_step(tmp_path):
    from jaxsched.integrations import checkpoint

    mesh, tx = _mesh(), optax.adam(1e-2)
    params = js.mlp_params(11)
    step = js.mlp_step(tx)
    batches = [js.place(mesh, b) for b in js.mlp_batches(12, 4, 16)]
    sched = jaxsched.schedule(step, strategy="dear")
    state = sched.init(_copy(params), tx.init(params))
    for b in batches[:2]:
        state, _ = sched(state, b)
    checkpoint.save(tmp_path / "ckpt", state)
    for b in batches[2:]:
        state, _ = sched(state, b)
    resumed = jaxsched.schedule(step, strategy="dear")
    target = resumed.init(params, tx.init(params), batches[0])
    restored = checkpoint.restore(tmp_path / "ckpt", target)
    for b in batches[2:]:
        restored, _ = resumed(restored, b)
    _close(resumed.finalize(restored), sched.finalize(state))


def test_auto_strategy_on_a_jit_step_is_exact():
    mesh, tx = _mesh(), optax.adam(1e-2)
    params = js.mlp_params(12)
    batches = [js.place(mesh, b) for b in js.mlp_batches(13, 3, 16)]
    sched = _run_trees(js.mlp_step(tx), params, tx.init(params), batches, "auto")
    assert sched.program.strategy.name in ("allreduce", "wfbp", "dear")


@needs_gpu
def test_a_jit_step_lowers_and_inspects_for_a_gpu_cluster_ahead_of_time():
    from jaxsched.tools.aot._experiment import ModelSpec, abstract_experiment
    from jaxsched.demo.config import OptimizerConfig

    spec = ModelSpec("mlp", (256,), 10, {"hidden": (256,) * 3}, 64, OptimizerConfig(name="momentum", learning_rate=0.1))
    exp = abstract_experiment(spec, target="h100:1x2x4", form="jit")
    sched = jaxsched.schedule(exp.step, strategy="wfbp", buckets=256 * 257 * 4)  # a layer each
    state = sched.init(exp.params, exp.opt_state)
    assert "stablehlo" in sched.lower(state, exp.batch).as_text()
    inspection = sched.inspect(state, exp.batch)
    grads = [w for w in inspection.report.collectives if w.kind == "all-reduce" and w.bytes >= 256 * 256 * 4]
    assert len(grads) >= 3, inspection.report.collectives
    # backward in their windows (two collectives in flight on GPU: the last layers' pair
    # overlap each other once backward is done)
    reduces = [w for w in inspection.report.collectives if w.kind == "all-reduce"]
    assert sum(w.is_async and w.compute_flops > 0 for w in reduces) >= 2, reduces
    assert inspection.baseline.step_s is not None and inspection.report.step_s is not None


@needs_tpu
@pytest.mark.slow
def test_a_jit_step_inspects_for_a_tpu_pod_ahead_of_time():
    from jaxsched.tools.aot._experiment import ModelSpec, abstract_experiment
    from jaxsched.demo.config import OptimizerConfig

    spec = ModelSpec("mlp", (256,), 10, {"hidden": (256,) * 2}, 16, OptimizerConfig(name="momentum", learning_rate=0.1))
    exp = abstract_experiment(spec, target="v5p:2x2x2", form="jit")
    sched = jaxsched.schedule(exp.step, strategy="dear")
    inspection = sched.inspect(sched.init(exp.params, exp.opt_state), exp.batch)
    kinds = {w.kind for w in inspection.report.collectives}
    assert "all-gather" in kinds or any("gather" in k for k in kinds), kinds


@pytest.mark.slow
def test_a_jit_step_on_the_host_engine_across_two_processes(tmp_path):
    """`jaxsched launch`'s set-up: two processes, the host engine staging the partitioned step."""
    import io
    import json
    import os
    import sys
    from pathlib import Path

    from jaxsched.tools import launch as launch_lib

    here = Path(__file__).parent
    env = {
        "PYTHONPATH": f"{here}{os.pathsep}{here.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "JAX_PLATFORMS": "cpu",
    }
    out, log = tmp_path / "report.json", io.StringIO()
    code = launch_lib.launch(
        2,
        [sys.executable, str(SUPPORT_DIR / "host_engine_worker.py"), str(out), "--jit", "wfbp", "dear"],
        env=env,
        stdout=log,
        stderr=log,
        timeout_s=240,
        grace_s=2,
    )
    assert code == 0, log.getvalue()[-4000:]
    report = json.loads(out.read_text())
    for strategy in ("wfbp", "dear"):
        assert report[strategy]["params_rel_gap"] < 1e-5, (strategy, report[strategy])
        assert report[f"{strategy}_stages"].count("comm") >= 1


def test_verify_a_step_with_an_extra_input():
    mesh, tx = _mesh(), optax.sgd(0.1)

    @jax.jit
    def update(params, opt_state, scale, batch):
        x, y = batch
        l, g = jax.value_and_grad(js.mlp_loss)(params, x * scale, y)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": l}

    params = js.mlp_params(15)
    sched = jaxsched.schedule(update, strategy="wfbp")
    batches = [(np.float32(0.5), js.place(mesh, b)) for b in js.mlp_batches(16, 2, 16)]
    report = sched.verify(sched.init(params, tx.init(params)), batches, steps=2)
    assert report.ok, str(report)


@pytest.mark.parametrize("strategy", ["wfbp", "dear", pytest.param("allreduce", marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ["easylm", "two_data_axes"])
def test_a_batch_split_inside_the_step_with_a_sharding_constraint(strategy, layout):
    """EasyLM passes its batch replicated and splits it in the step with
    ``with_sharding_constraint(batch, P(('dp', 'fsdp')))``: the data axes are read from there
    (size-one axes are not data axes), and each device computes only its rows."""
    if layout == "easylm":
        mesh = _mesh((8, 1, 1), ("dp", "fsdp", "mp"))  # its data-parallel mesh: model axes of size 1
        param_spec, data = P("fsdp", "mp"), ("dp",)
    else:
        mesh = _mesh((4, 2), ("dp", "fsdp"))
        param_spec, data = P(), ("dp", "fsdp")
    tx = optax.adamw(1e-2)
    base = js.mlp_step(tx)

    @jax.jit
    def step(params, opt_state, batch):
        batch = jax.lax.with_sharding_constraint(batch, NamedSharding(mesh, P(("dp", "fsdp"))))
        return base(params, opt_state, batch)

    params = {
        k: jax.device_put(v, NamedSharding(mesh, param_spec if v.ndim == 2 else P()))
        for k, v in js.mlp_params(np.random.randint(1 << 20)).items()
    }
    whole = NamedSharding(mesh, P())
    batches = [jax.device_put(b, whole) for b in js.mlp_batches(np.random.randint(1 << 20), 3, 16)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsched.GatherWarning)
        sched = _run_trees(step, params, tx.init(params), batches, strategy)
    captured = sched.program.captured
    assert tuple(jaxsched.core._axes.as_axes(captured.axis_name)) == data
    if strategy != "allreduce":  # the loss runs on this device's rows: 16 / 8
        assert any(e.primitive.name == "dot_general" and e.invars[0].aval.shape[0] == 2 for e in captured.body.eqns), (
            captured.body
        )
