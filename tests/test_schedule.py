"""jaxsched.schedule: equivalence with the plain step, structure, memory, round trips, errors."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxsched
from jaxsched.demo import steps
from support.equivalence import assert_placed_like, assert_trees_close, build, random_batches, run_both

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
}


def _check(model, opt, strategy, devices, api="shard_map", n_steps=20, **kw):
    plain, scheduled, plain_aux, sched_aux, sched = run_both(
        model, OPTIMIZERS[opt](), strategy, devices, n_steps=n_steps, api=api, **kw
    )
    assert_trees_close(plain, scheduled)
    assert_placed_like(plain, scheduled)
    assert_trees_close(plain_aux, sched_aux)
    return sched


@pytest.mark.parametrize("strategy", [pytest.param("wfbp", marks=pytest.mark.slow), "dear"])
@pytest.mark.parametrize(
    "opt", [o if o in ("adam", "clip+adamw") else pytest.param(o, marks=pytest.mark.slow) for o in sorted(OPTIMIZERS)]
)
def test_every_optimizer_matches_the_plain_step_on_8_devices(strategy, opt):
    sched = _check("mlp", opt, strategy, 8)
    assert sched.program.fallbacks == []  # all of these run on shards without gathering


@pytest.mark.parametrize("strategy", [pytest.param("wfbp", marks=pytest.mark.slow), "dear"])
@pytest.mark.parametrize(
    "model", [pytest.param("cnn", marks=pytest.mark.slow), pytest.param("transformer", marks=pytest.mark.slow)]
)  # the heaviest compiles run in `make test-slow` (CI runs both)
def test_zoo_models_match_the_plain_step(model, strategy):
    _check(model, "clip+adamw", strategy, 8)


# 1 and 4 devices run in make test-slow (the make test budget); 2 and 8 in both
@pytest.mark.parametrize(
    "devices", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow), 8]
)
def test_dear_matches_on_every_device_count(devices):
    _check("mlp", "adam", "dear", devices)


@pytest.mark.parametrize("strategy", [pytest.param("wfbp", marks=pytest.mark.slow), "dear"])
@pytest.mark.parametrize("model", ["mlp", pytest.param("cnn", marks=pytest.mark.slow)])
def test_pmap_steps_match(model, strategy):
    _check(model, "adamw", strategy, 4, api="pmap", n_steps=10)


def test_allreduce_is_bit_identical_to_the_users_step():
    plain, scheduled, plain_aux, sched_aux, _ = run_both("mlp", optax.adam(1e-2), "allreduce", 8, n_steps=5)
    for a, b in zip(jax.tree.leaves((plain, plain_aux)), jax.tree.leaves((scheduled, sched_aux))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _running_sum(updates):
    """A transformation with no shard rule: each leaf's rows in reverse order, added."""
    return jax.tree.map(lambda u: u + lax.rev(u, (0,)), updates)


def test_non_elementwise_optimizer_falls_back_and_says_so_once():
    tx = optax.chain(optax.scale_by_adam(), optax.stateless(lambda u, p: _running_sum(u)), optax.scale(-1e-2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain, scheduled, plain_aux, sched_aux, sched = run_both("mlp", tx, "dear", 8, n_steps=10)
    assert_trees_close(plain, scheduled)
    assert_trees_close(plain_aux, sched_aux)
    messages = [str(w.message) for w in caught if issubclass(w.category, jaxsched.FallbackWarning)]
    # Each message names the primitive and the optimizer's source line that needs full tensors.
    assert messages and all(re.search(r"test_schedule\.py:\d+", m) for m in messages)
    assert any(m.startswith("jaxsched: rev at ") for m in messages)
    assert len(messages) == len(set(messages)) == len(sched.program.fallbacks)


def test_explicit_bucket_plan_and_byte_threshold():
    params, _ = build("mlp", 0)
    paths = jaxsched.core._bucketing.param_paths(params)
    plan = [paths[:2], paths[2:4], paths[4:]]
    sched = _check("mlp", "adam", "dear", 8, n_steps=5, buckets=plan)
    assert len(sched.program.buckets) == 3
    # the bucket size an accelerator's combiner is capped at: the largest explicit bucket
    sizes = [
        sum(int(np.prod(jax.tree.leaves(params)[i].shape)) * 4 for i in range(len(paths)) if paths[i] in group)
        for group in plan
    ]
    assert sched.program.per_device.bucket_bytes == max(sizes)
    sched = _check("mlp", "adam", "wfbp", 8, n_steps=5, buckets=1)
    assert len(sched.program.buckets) == len(paths)
    assert sched.program.per_device.bucket_bytes == 1  # a threshold is the cap itself


@pytest.mark.slow
def test_bucket_plans_accept_subtree_prefixes():
    params, _ = build("mlp", 0)
    paths = jaxsched.core._bucketing.param_paths(params)
    sched = _check("mlp", "adam", "dear", 8, n_steps=3, buckets=[["hidden"], ["head"]])
    hidden = {paths.index(p) for p in paths if p.startswith("hidden/")}
    assert [set(b.params) for b in sched.program.buckets] == [set(range(len(paths))) - hidden, hidden]
    for bad, message in (
        ([["hidden"], ["hidden/0"], ["head"]], "in buckets\\[0\\] and buckets\\[1\\]"),
        ([["hid"], ["head"]], "unknown parameter 'hid'.*subtree prefix"),
    ):
        with pytest.raises(ValueError, match=message):
            _check("mlp", "adam", "wfbp", 8, n_steps=1, buckets=bad)


# -- property test over random parameter trees ----------------------------------------------
shapes = st.lists(st.integers(1, 9), min_size=0, max_size=3).map(tuple)


@pytest.mark.slow  # a heavy compile: runs in `make test-slow` (CI runs both)
@settings(max_examples=6, deadline=None, derandomize=True)  # same examples in every CI run
@given(
    tree_shapes=st.dictionaries(st.sampled_from(list("abcdef")), shapes, min_size=1, max_size=4),
    devices=st.sampled_from([2, 8]),
    seed=st.integers(0, 2**16),
)
def test_dear_matches_on_random_parameter_trees(tree_shapes, devices, seed):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in tree_shapes.items()}
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))

    def body(p, s, x):
        loss = sum(jnp.mean(jnp.sin(leaf * x.mean()) ** 2) for leaf in jax.tree.leaves(p))
        grads = lax.pmean(
            jax.grad(lambda q: sum(jnp.mean(jnp.sin(l * x.mean()) ** 2) for l in jax.tree.leaves(q)))(p), "data"
        )
        u, s = tx.update(grads, s, p)
        return optax.apply_updates(p, u), s, lax.pmean(loss, "data")

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )
    sched = jaxsched.schedule(step, strategy="dear")
    plain = (params, tx.init(params))
    state = sched.init(*plain)
    for _ in range(3):
        x = steps.shard_batch(rng.standard_normal((devices * 2, 3)).astype(np.float32), mesh)
        *plain, aux = step(*plain, x)
        state, sched_aux = sched(state, x)
        np.testing.assert_allclose(aux, sched_aux, rtol=1e-5)
    assert_trees_close(tuple(plain), sched.finalize(state))


def test_check_vma_step_with_implicit_reduction():
    params, apply_fn = build("mlp", 1)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    tx = optax.adam(1e-2)

    def body(p, s, batch):  # check_vma=True: JAX psums the gradients in backward itself
        x, y = batch
        loss, g = jax.value_and_grad(lambda q: steps.cross_entropy(apply_fn(q, x), y))(p)
        u, s = tx.update(jax.tree.map(lambda a: a / 4, g), s, p)
        return optax.apply_updates(p, u), s, lax.pmean(loss, "data")

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())))
    sched = jaxsched.schedule(step, strategy="dear")
    plain, state = (params, tx.init(params)), sched.init(params, tx.init(params))
    for x, y in random_batches("mlp", 5, 8, 3):
        batch = steps.shard_batch((x, y), mesh)
        *plain, _ = step(*plain, batch)
        state, _ = sched(state, batch)
    assert_trees_close(tuple(plain), sched.finalize(state))


# -- structure of the lowered program --------------------------------------------------------
def _lowered_text(strategy, buckets=1, devices=8):
    params, apply_fn = build("mlp", 0)
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy=strategy, buckets=buckets)
    x, y = next(random_batches("mlp", 1, 2 * devices, 0))
    text = sched.lower(sched.init(params, tx.init(params)), steps.shard_batch((x, y), mesh)).as_text()
    return text, sched


def _ops(text):
    """(line number, op name, operand type) of every collective and dot, in program order."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = re.search(r'"?stablehlo\.(all_reduce|reduce_scatter|all_gather|dot_general)"?', line)
        if m:
            # The operand type follows the op's region (all_reduce) or sits on its line.
            sig = re.search(r"\) : \((tensor<[^>]*>)", "\n".join(lines[i : i + 12]))
            found.append((i, m.group(1), sig.group(1) if sig else ""))
    return found


#: the demo step's aux (loss, accuracy) means over the devices: one scalar each, or one vector
#: of both where the update region batches its scalar sums
AUX_SUMS = ("tensor<f32>", "tensor<2xf32>")


def test_dear_program_has_a_reduce_scatter_and_all_gather_per_bucket_and_no_gradient_all_reduce():
    text, sched = _lowered_text("dear", buckets=1)
    n_buckets = len(sched.program.buckets)
    ops = _ops(text)
    names = [name for _, name, _ in ops]
    assert n_buckets == 6
    assert names.count("reduce_scatter") == n_buckets
    assert names.count("all_gather") == n_buckets
    gradient_all_reduces = [line for _, name, line in ops if name == "all_reduce" and line not in AUX_SUMS]
    assert gradient_all_reduces == []
    # Each bucket's all-gather comes before the first forward use of its parameters: the
    # gathers are interleaved with the forward matmuls rather than all issued up front.
    # Forward has three matmuls (two hidden layers and the head); with one parameter per
    # bucket, a layer's kernel and bias are gathered just before that layer, not up front.
    dots = [k for k, n in enumerate(names) if n == "dot_general"][:3]
    gathered_before = [names[:d].count("all_gather") for d in dots]
    assert gathered_before[0] >= 1
    assert all(g <= 2 * (k + 1) for k, g in enumerate(gathered_before)), gathered_before
    assert gathered_before[0] < gathered_before[1] < gathered_before[2], gathered_before
    # ...and the first reduce-scatter starts while backward matmuls remain.
    last_dot = len(names) - 1 - names[::-1].index("dot_general")
    assert names.index("reduce_scatter") < last_dot


def test_wfbp_program_interleaves_one_all_reduce_per_bucket_with_backward():
    text, sched = _lowered_text("wfbp", buckets=1)
    ops = _ops(text)
    names = [name for _, name, _ in ops]
    grad_ars = [k for k, (_, n, line) in enumerate(ops) if n == "all_reduce" and line not in AUX_SUMS]
    assert len(grad_ars) == len(sched.program.buckets) == 6
    last_dot = len(names) - 1 - names[::-1].index("dot_general")
    assert grad_ars[0] < last_dot  # the first bucket is reduced while backward continues
    assert "reduce_scatter" not in names and "all_gather" not in names


def test_default_buckets_fuse_small_models_into_one_bucket():
    _, sched = _lowered_text("dear", buckets=None)
    assert len(sched.program.buckets) == 1


# -- memory ----------------------------------------------------------------------------------
def test_dear_keeps_one_over_p_of_the_optimizer_state_per_device():
    params, apply_fn = build("mlp", 0)
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((8,), ("data",))
    sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="dear")
    state = sched.init(params, tx.init(params))
    x, y = next(random_batches("mlp", 1, 16, 0))
    state, _ = sched(state, steps.shard_batch((x, y), mesh))
    per_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state.opt_state))
    plain_bytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(tx.init(params)))
    ratio = per_device / plain_bytes
    assert ratio <= 1 / 8 * 1.1, ratio  # 1/P plus padding of at most P-1 elements per leaf
    param_bytes = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state.params))
    assert param_bytes <= sum(np.asarray(p).nbytes for p in jax.tree.leaves(params)) / 8 * 1.1


# wfbp's twins of the dear cases above run in `make test-slow` (CI runs both)


# -- round trips -----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "dear"])
def test_finalize_of_init_is_the_identity(strategy):
    params, apply_fn = build("cnn", 0)
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((8,), ("data",))
    sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy=strategy)
    opt_state = tx.init(params)
    back = sched.finalize(sched.init(params, opt_state))
    for a, b in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_orbax_checkpoint_resumes_with_an_identical_trajectory(tmp_path):
    import orbax.checkpoint as ocp

    params, apply_fn = build("mlp", 0)
    tx = optax.adam(1e-2)
    mesh = jax.make_mesh((8,), ("data",))
    step = steps.make_step(apply_fn, tx, mesh)
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", 6, 16, 9)]
    sched = jaxsched.schedule(step, strategy="dear")
    state = sched.init(params, tx.init(params))
    for b in batches[:3]:
        state, _ = sched(state, b)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    uninterrupted = state
    for b in batches[3:]:
        uninterrupted, _ = sched(uninterrupted, b)

    resumed_sched = jaxsched.schedule(step, strategy="dear")
    # An example batch gives the scheduled layout at init: the restore target.
    template = resumed_sched.init(params, tx.init(params), batches[0])
    assert jax.tree.structure(template) == jax.tree.structure(state)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    for b in batches[3:]:
        restored, _ = resumed_sched(restored, b)
    for a, b in zip(jax.tree.leaves(sched.finalize(uninterrupted)), jax.tree.leaves(resumed_sched.finalize(restored))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- bad input -------------------------------------------------------------------------------
def _mesh(n=2):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _simple_call(body, n=2, **shard_kw):
    mesh = _mesh(n)
    step = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False, **shard_kw
        )
    )
    params = {"w": np.ones((3,), np.float32)}
    sched = jaxsched.schedule(step, strategy="dear")
    state = sched.init(params, optax.sgd(0.1).init(params))
    return sched, state, steps.shard_batch(np.ones((4, 3), np.float32), mesh)


def test_step_without_gradient_reduction_is_rejected():
    def body(p, s, x):
        g = jax.grad(lambda q: jnp.sum(q["w"] * x))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), s, jnp.zeros(())

    sched, state, batch = _simple_call(body)
    with pytest.raises(jaxsched.UnsupportedStepError, match="no gradient reduction over mesh axis 'data'"):
        sched(state, batch)


def test_reduction_over_an_axis_not_in_the_mesh_is_rejected():
    def body(p, s, x):
        g = lax.pmean(jax.grad(lambda q: jnp.sum(q["w"] * x))(p), "model")
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), s, jnp.zeros(())

    with pytest.raises(jaxsched.UnsupportedStepError, match="not in its mesh.*model"):
        sched, state, batch = _simple_call(body)
        sched(state, batch)


def test_outputs_that_do_not_match_the_inputs_are_rejected():
    def body(p, s, x):
        g = lax.pmean(jax.grad(lambda q: jnp.sum(q["w"] * x))(p), "data")
        return {"w": p["w"] - g["w"], "extra": p["w"]}, s, jnp.zeros(())

    mesh = _mesh()
    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )
    params = {"w": np.ones((3,), np.float32)}
    sched = jaxsched.schedule(step, strategy="wfbp")
    with pytest.raises(
        jaxsched.UnsupportedStepError, match="output params differs from its input params: it has extra leaves extra;"
    ):
        sched(sched.init(params, ()), steps.shard_batch(np.ones((4, 3), np.float32), mesh))


def test_batch_that_does_not_divide_is_rejected():
    with pytest.raises(ValueError, match="not divisible by the 8 devices"):
        steps.shard_batch(np.ones((12, 3), np.float32), _mesh(8))


def test_unknown_strategy_and_bad_buckets_are_named():
    with pytest.raises(ValueError, match="strategy='deer'"):
        jaxsched.schedule(lambda *a: a, strategy="deer")
    with pytest.raises(ValueError, match="unknown parameter 'nope'"):
        _check("mlp", "sgd", "dear", 2, n_steps=1, buckets=[["nope"]])


def test_decorator_form():
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.1)
    mesh = _mesh(2)

    @jaxsched.schedule(strategy="wfbp")
    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    def step(p, s, batch):
        return steps.local_step_fn(apply_fn, tx, "data")(p, s, batch)

    assert isinstance(step, jaxsched.Scheduled)
    state, aux = step(step.init(params, tx.init(params)), steps.shard_batch(next(random_batches("mlp", 1, 4, 0)), mesh))
    assert np.isfinite(aux["loss"])


@pytest.mark.parametrize("strategy", [pytest.param("wfbp", marks=pytest.mark.slow), "dear"])
def test_bf16_params_with_f32_optimizer_state_keep_their_dtypes(strategy):
    params, apply_fn = build("mlp", 4)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), params)
    tx = optax.adam(1e-2, mu_dtype=jnp.float32)
    mesh = jax.make_mesh((8,), ("data",))
    step = steps.make_step(apply_fn, tx, mesh)
    sched = jaxsched.schedule(step, strategy=strategy)
    plain, state = (params, tx.init(params)), sched.init(params, tx.init(params))
    dtypes = {str(a.dtype) for a in jax.tree.leaves(plain)}
    assert dtypes == {"bfloat16", "float32", "int32"}, dtypes
    for x, y in random_batches("mlp", 5, 16, 2):
        batch = steps.shard_batch((x, y), mesh)
        *plain, _ = step(*plain, batch)
        state, _ = sched(state, batch)
    for a, b in zip(jax.tree.leaves(tuple(plain)), jax.tree.leaves(sched.finalize(state))):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        # bf16 sums in a different order round differently: compare at bf16 precision.
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


# -- buckets="auto": cost-model planning -----------------------------------------------------
def test_auto_buckets_with_measured_network_stay_exact():
    sched = _check("mlp", "adam", "dear", 8, n_steps=5, buckets="auto")
    program = sched.program
    assert [layer.name for layer in program.layer_profile.layers] == ["hidden/0", "hidden/1", "head"]
    assert program.network_profile.workers == 8
    assert program.layer_profile.layers[0].forward_s > 0


def test_auto_buckets_split_when_compute_is_long_enough_to_hide_communication():
    from jaxsched.sim._costmodel import Layer, LayerProfile

    # Seconds of compute per layer against a 1 GbE model: overlapping pays, so the
    # optimal wfbp plan sends more than one bucket.
    measured = LayerProfile([Layer(name, 1, 10**8, 1.0, 2.0) for name in ("hidden/0", "hidden/1", "head")])
    sched = _check("mlp", "sgd", "wfbp", 4, n_steps=3, buckets="auto", layer_profile=measured, network_profile="1gbe")
    assert len(sched.program.buckets) > 1
    # Buckets follow gradient completion: the head's gradient is ready first.
    params, _ = build("mlp", 0)
    paths = jaxsched.core._bucketing.param_paths(params)
    first = {paths[i].rsplit("/", 1)[0] for i in sched.program.buckets[0].params}
    assert "head" in first


def test_auto_buckets_reject_a_profile_with_other_layer_names():
    from jaxsched.sim._costmodel import Layer, LayerProfile

    wrong = LayerProfile([Layer("conv1", 1, 4, 1e-3, 2e-3)])
    with pytest.raises(ValueError, match="no layers named hidden/0"):
        _check("mlp", "sgd", "wfbp", 2, n_steps=1, buckets="auto", layer_profile=wrong, network_profile="10gbe")


def test_unknown_schedule_option_is_named():
    with pytest.raises(TypeError, match="layer_profil"):
        jaxsched.schedule(lambda *a: a, strategy="wfbp", layer_profil=None)


def test_step_that_closes_over_arrays():
    params, apply_fn = build("mlp", 2)
    class_weights = jnp.linspace(0.5, 1.5, 10)  # a closed-over array becomes a constant input
    tx = optax.adam(1e-2)
    mesh = _mesh(4)

    def body(p, s, batch):
        x, y = batch
        loss_fn = lambda q: jnp.mean(
            class_weights[y] * optax.softmax_cross_entropy_with_integer_labels(apply_fn(q, x), y)
        )
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = tx.update(lax.pmean(g, "data"), s, p)
        return optax.apply_updates(p, u), s, lax.pmean(loss, "data")

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )
    for strategy in ("wfbp", "dear"):
        sched = jaxsched.schedule(step, strategy=strategy)
        plain, state = (params, tx.init(params)), sched.init(params, tx.init(params))
        for x, y in random_batches("mlp", 4, 8, 5):
            batch = steps.shard_batch((x, y), mesh)
            *plain, loss = step(*plain, batch)
            state, sched_loss = sched(state, batch)
            np.testing.assert_allclose(loss, sched_loss, rtol=1e-5)
        assert_trees_close(tuple(plain), sched.finalize(state))


def test_jitted_loss_and_jitted_reduction_are_inlined_and_scheduled():
    params, apply_fn = build("mlp", 3)
    tx = optax.adam(1e-2)
    mesh = _mesh(4)

    @jax.jit
    def loss_fn(p, x, y):  # forward and backward hidden in one call equation
        return steps.cross_entropy(apply_fn(p, x), y)

    @jax.jit
    def sync(g):  # the reduction hidden in another
        return lax.pmean(g, "data")

    def body(p, s, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, *batch)
        u, s = tx.update(sync(g), s, p)
        return optax.apply_updates(p, u), s, lax.pmean(loss, "data")

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )
    sched = jaxsched.schedule(step, strategy="dear", buckets=1)
    plain, state = (params, tx.init(params)), sched.init(params, tx.init(params))
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", 5, 8, 4)]
    for batch in batches:
        *plain, loss = step(*plain, batch)
        state, sched_loss = sched(state, batch)
        np.testing.assert_allclose(loss, sched_loss, rtol=1e-5)
    assert_trees_close(tuple(plain), sched.finalize(state))
    # Inlined, the gradients appear one by one: the first reduce-scatter precedes the last
    # backward matmul, as for an unjitted loss.
    names = [n for _, n, _ in _ops(sched.lower(state, batches[0]).as_text())]
    last_dot = len(names) - 1 - names[::-1].index("dot_general")
    assert names.count("reduce_scatter") == len(sched.program.buckets) == 6
    assert names.index("reduce_scatter") < last_dot


def test_reduction_inside_a_scan_is_named():
    def body(p, s, x):
        def micro(carry, xi):
            g = jax.grad(lambda q: jnp.sum(q["w"] * xi))(p)
            return jax.tree.map(lambda a, b: a + lax.pmean(b, "data"), carry, g), None

        g, _ = lax.scan(micro, jax.tree.map(jnp.zeros_like, p), x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), s, jnp.zeros(())

    sched, state, batch = _simple_call(body)
    with pytest.raises(jaxsched.UnsupportedStepError, match=r"inside a nested scan at .*test_schedule\.py"):
        sched(state, batch)
