"""K-FAC (jaxsched.integrations.kfac): a float64 reference on one device, 8 devices against 1, every
placement against naive, layer discovery, fallback reporting, bad options."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxsched
from jaxsched.demo import steps
from jaxsched.integrations.kfac import KFAC, KFACFallbackWarning, find_layers, max_load, plan_placement

D_IN, HIDDEN, CLASSES = 6, 5, 3


def _params(dtype=np.float32, seed=0, extra=False):
    rng = np.random.default_rng(seed)
    p = {
        "l0": {"kernel": rng.normal(0, 0.5, (D_IN, HIDDEN)), "bias": rng.normal(0, 0.1, HIDDEN)},
        "l1": {"kernel": rng.normal(0, 0.5, (HIDDEN, CLASSES)), "bias": rng.normal(0, 0.1, CLASSES)},
    }
    if extra:
        p["temp"] = np.ones(())
    return jax.tree.map(lambda a: np.asarray(a, dtype), p)


def _apply(p, x):
    h = jax.nn.relu(x @ p["l0"]["kernel"] + p["l0"]["bias"])
    out = h @ p["l1"]["kernel"] + p["l1"]["bias"]
    return out * p["temp"] if "temp" in p else out


def _step(mesh, tx, apply=_apply):
    def body(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: steps.cross_entropy(apply(p, x), y))(params)
        grads = lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": lax.pmean(loss, "data")}

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )


def _batches(n, size=16, dtype=np.float32, seed=1):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(size, D_IN)).astype(dtype), rng.integers(0, CLASSES, size).astype(np.int32)) for _ in range(n)
    ]


def _mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _run(n_dev, strategy, batches, params, tx):
    mesh = _mesh(n_dev)
    sched = jaxsched.schedule(_step(mesh, tx), strategy=strategy)
    state = sched.init(params, tx.init(params))
    for b in batches:
        state, aux = sched(state, steps.shard_batch(b, mesh))
        jax.block_until_ready(aux)
    return state


# ----------------------------------------------------------------- the float64 reference
def _reference(params, batches, lr, damping, decay, inverse_interval):
    """Dense K-FAC written out in numpy float64: per-example backprop, empirical Fisher."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    factors, inverses, history = None, None, []
    for t, (x, y) in enumerate(batches):
        n = len(x)
        s0 = x @ p["l0"]["kernel"] + p["l0"]["bias"]
        h = np.maximum(s0, 0)
        s1 = h @ p["l1"]["kernel"] + p["l1"]["bias"]
        prob = np.exp(s1 - s1.max(1, keepdims=True))
        prob /= prob.sum(1, keepdims=True)
        d1 = prob - np.eye(CLASSES)[y]  # per-example d loss_i / d s1
        d0 = (d1 @ p["l1"]["kernel"].T) * (s0 > 0)
        acts = [np.hstack([x, np.ones((n, 1))]), np.hstack([h, np.ones((n, 1))])]
        deltas = [d0, d1]
        new = [(a.T @ a / n, d.T @ d / n) for a, d in zip(acts, deltas)]
        factors = (
            new
            if factors is None
            else [tuple(decay * o + (1 - decay) * m for o, m in zip(old, nw)) for old, nw in zip(factors, new)]
        )
        if t % inverse_interval == 0:
            inverses = []
            for a, g in factors:
                pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
                inverses.append(
                    (
                        np.linalg.inv(a + pi * np.sqrt(damping) * np.eye(len(a))),
                        np.linalg.inv(g + np.sqrt(damping) / pi * np.eye(len(g))),
                    )
                )
        for k, name in enumerate(("l0", "l1")):
            grad = acts[k].T @ deltas[k] / n  # [d kernel; d bias] of the mean loss
            update = inverses[k][0] @ grad @ inverses[k][1]
            p[name] = {"kernel": p[name]["kernel"] - lr * update[:-1], "bias": p[name]["bias"] - lr * update[-1]}
        history.append(jax.tree.map(np.copy, p))
    return history


@pytest.mark.parametrize("inverse", ["eigh", pytest.param("cholesky", marks=pytest.mark.slow)])
def test_one_device_equals_a_float64_dense_reference(inverse):
    lr, damping, decay = 0.5, 1e-2, 0.7
    with jax.enable_x64(True):
        params = _params(np.float64)
        batches = _batches(3, dtype=np.float64)
        tx = optax.sgd(lr)
        mesh = _mesh(1)
        sched = jaxsched.schedule(
            _step(mesh, tx), strategy=KFAC(damping=damping, ema_decay=decay, inverse_interval=2, inverse=inverse)
        )
        state = sched.init(params, tx.init(params))
        expected = _reference(params, batches, lr, damping, decay, inverse_interval=2)
        for b, want in zip(batches, expected):
            state, _ = sched(state, steps.shard_batch(b, mesh))
            got = jax.tree.map(np.asarray, state.params)
            assert jax.tree.leaves(got)[0].dtype == np.float64
            jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-9), got, want)


BASE = dict(damping=1e-2, inverse_interval=1)


@functools.lru_cache(maxsize=None)
def _reference_run(n_dev: int, placement: str):
    """One- and eight-device runs shared by the tests below (each compile costs seconds)."""
    params, batches, tx = _params(), _batches(2, size=32), optax.sgd(0.3)
    return _run(n_dev, KFAC(placement=placement, factor_buckets="per_layer", **BASE), batches, params, tx)


def test_eight_devices_equal_one_device_for_the_same_global_batch():
    one, eight = _reference_run(1, "balanced"), _reference_run(8, "naive")
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
        (one.params, one.factors),
        (eight.params, eight.factors),
    )


def test_one_example_per_device_matches_its_biases_and_equals_one_device():
    """With one row per device JAX sums nothing for a bias gradient (a reshape of ``g``):
    the bias is still matched, so eight devices take the step one device takes."""
    params, batches, tx = _params(), _batches(2, size=8), optax.sgd(0.3)
    mesh = _mesh(8)
    found = jaxsched.kfac.find_layers(_step(mesh, tx), params, tx.init(params), steps.shard_batch(batches[0], mesh))
    assert found.unmatched == () and [layer.dims for layer in found.layers] == [
        (D_IN + 1, HIDDEN),
        (HIDDEN + 1, CLASSES),
    ]
    options = dict(placement="balanced", factor_buckets="per_layer", **BASE)
    one, eight = _run(1, KFAC(**options), batches, params, tx), _run(8, KFAC(**options), batches, params, tx)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
        (one.params, one.factors),
        (eight.params, eight.factors),
    )


def _assert_same_numbers(a, b):
    """Same numbers up to float rounding: an inverse computed inside one worker's branch
    of the placement is fused differently from the inline one (a few ulps)."""
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
        (a.params, a.inverses),
        (b.params, b.inverses),
    )


PLACEMENT_CASES = {
    "balanced": dict(placement="balanced", factor_buckets="per_layer"),
    "round_robin, one factor bucket": dict(placement="round_robin", factor_buckets=10**9),
    "factors after backward": dict(placement="balanced", pipeline=False, factor_buckets=[["l0", "l1"]]),
}


@pytest.mark.parametrize(
    "case", ["balanced", *[pytest.param(c, marks=pytest.mark.slow) for c in PLACEMENT_CASES if c != "balanced"]]
)
def test_placements_and_factor_schedules_give_the_naive_numbers(case):
    if case == "balanced":
        other = _reference_run(8, "balanced")
    else:
        params, batches, tx = _params(), _batches(2, size=32), optax.sgd(0.3)
        other = _run(8, KFAC(**PLACEMENT_CASES[case], **BASE), batches, params, tx)
    _assert_same_numbers(_reference_run(8, "naive"), other)


@pytest.mark.slow
def test_factor_interval_skips_factor_updates_and_inverses_stay_between_refreshes():
    params, batches, tx = _params(), _batches(4, size=16), optax.sgd(0.1)
    state = _run(2, KFAC(factor_interval=2, inverse_interval=3, factor_buckets="per_layer"), batches, params, tx)
    assert int(state.step) == 4 and int(state.factor_updates) == 2


def test_layers_are_found_in_the_jaxpr_and_the_rest_is_reported_once_by_name():
    params, tx, mesh = _params(extra=True), optax.sgd(0.1), _mesh(1)
    step = _step(mesh, tx)
    batch = steps.shard_batch(_batches(1)[0], mesh)
    found = find_layers(step, params, tx.init(params), batch)
    assert [(l.name, l.kind, l.dims) for l in found.layers] == [("l0", "dense", (7, 5)), ("l1", "dense", (6, 3))]
    assert found.unmatched == ("temp",)
    sched = jaxsched.schedule(step, strategy="kfac", factor_buckets="per_layer")
    state = sched.init(params, tx.init(params))
    with pytest.warns(KFACFallbackWarning, match="params/temp is not part of a dense or convolution"):
        state, _ = sched(state, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KFACFallbackWarning)
        sched(state, batch)  # reported once


def test_conv_factors_use_the_kernel_layout_of_the_gradient():
    """A's rows (patches) and the kernel matrix K-FAC preconditions are laid out alike:
    patches @ kernel_matrix(W) is the convolution itself."""
    from jaxsched.strategies._kfac import kernel_from_matrix, kernel_matrix, local_factors

    dn = ("NHWC", "HWIO", "NHWC")

    def conv(p, x):
        y = (
            lax.conv_general_dilated(
                x, p["conv"]["kernel"], (2, 1), ((1, 1), (0, 1)), (1, 1), (1, 2), dimension_numbers=dn
            )
            + p["conv"]["bias"]
        )
        return y.mean(axis=(1, 2))

    rng = np.random.default_rng(0)
    params = {"conv": {"kernel": rng.normal(size=(3, 3, 2, 3)).astype(np.float32), "bias": np.zeros(3, np.float32)}}
    tx, mesh = optax.sgd(0.1), _mesh(1)
    batch = (rng.normal(size=(2, 6, 6, 2)).astype(np.float32), np.zeros(2, np.int32))
    found = find_layers(_step(mesh, tx, conv), params, tx.init(params), steps.shard_batch(batch, mesh))
    (layer,) = found.layers
    assert layer.kind == "conv" and layer.dims == (3 * 3 * 2 + 1, 3) and layer.bias is not None
    p = layer.params

    @jax.jit
    def check(x, w):
        patches = lax.conv_general_dilated_patches(
            x,
            p["filter_shape"],
            p["window_strides"],
            p["padding"],
            p["lhs_dilation"],
            p["rhs_dilation"],
            p["dimension_numbers"],
        )
        y = lax.conv_general_dilated(
            x, w, p["window_strides"], p["padding"], p["lhs_dilation"], p["rhs_dilation"], p["dimension_numbers"]
        )
        a, g = local_factors(layer, x, y, jnp.float32)
        return (
            patches.reshape(-1, 18) @ kernel_matrix(layer, w),
            y.reshape(-1, 3),
            kernel_from_matrix(layer, kernel_matrix(layer, w), w.shape),
            a,
            g,
        )

    via_patches, direct, round_trip, a, g = check(batch[0], params["conv"]["kernel"])
    np.testing.assert_allclose(via_patches, direct, atol=1e-5)
    np.testing.assert_array_equal(round_trip, params["conv"]["kernel"])
    assert a.shape == (19, 19) and g.shape == (3, 3)


@pytest.mark.slow
def test_cnn_trains_on_eight_devices_like_one():
    from jaxsched.zoo import models

    params, apply_fn = models.pure(models.build("cnn", (6, 6, 1), 3, channels=2, blocks=1))
    tx = optax.sgd(0.05)
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(16, 6, 6, 1)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32)) for _ in range(2)
    ]
    out = []
    for n in (1, 8):
        mesh = _mesh(n)
        sched = jaxsched.schedule(
            steps.make_step(apply_fn, tx, mesh), strategy="kfac", damping=1e-2, factor_buckets="per_layer"
        )
        state = sched.init(params, tx.init(params))
        for b in batches:
            state, aux = sched(state, steps.shard_batch(b, mesh))
            jax.block_until_ready(aux)
        out.append(state.params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), *out)


def test_balanced_placement_beats_round_robin_on_uneven_layers():
    dims = [513, 10, 257, 10, 129, 10, 65, 10]  # (A, G) of four layers
    layers = [0, 0, 1, 1, 2, 2, 3, 3]
    balanced = plan_placement(dims, 2, "balanced", layers)
    round_robin = plan_placement(dims, 2, "round_robin", layers)
    assert round_robin == (0, 0, 1, 1, 0, 0, 1, 1)
    assert max_load(dims, balanced, 2) < max_load(dims, round_robin, 2)
    assert plan_placement(dims, 2, "naive") is None


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(damping=0.0), "damping=0.0 must be a finite number > 0"),
        (dict(damping=-1e-3), "damping=-0.001 must be a finite number > 0"),
        (dict(inverse_interval=0), "inverse_interval=0 must be an int >= 1"),
        (dict(factor_interval=0), "factor_interval=0 must be an int >= 1"),
        (dict(placement="random"), "placement='random' is unknown"),
        (dict(inverse="svd"), "inverse='svd' is unknown"),
        (dict(factor_buckets="fast"), "factor_buckets='fast' is not understood"),
    ],
)
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        KFAC(**options)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        jaxsched.schedule(lambda *a: a, strategy="kfac", **options)


def test_simulator_reads_factor_collectives_and_placement_from_the_pattern():
    import dataclasses
    from jaxsched.sim._costmodel import KFAC_PATTERN, Layer, LayerProfile, network_preset
    from jaxsched.sim import simulate

    layers = LayerProfile(
        [
            Layer(
                f"l{i}",
                1000,
                4000,
                1e-3,
                2e-3,
                factor_bytes=4 * 2 * n * n,
                factor_s=1e-3,
                factor_dims=(n, n),
                inverse_s=(n**3 * 1e-9,) * 2,
            )
            for i, n in enumerate((800, 100, 400, 50))
        ]
    )
    assert LayerProfile.from_dict(layers.to_dict()) == layers
    net = network_preset("10gbe", 8)
    time = {
        (pipe, place): simulate(
            layers, net, dataclasses.replace(KFAC_PATTERN, factors_in_backward=pipe, inverse_placement=place)
        ).iteration_s
        for pipe in (True, False)
        for place in ("balanced", "round_robin", "naive")
    }
    assert time[True, "balanced"] <= time[True, "round_robin"] < time[True, "naive"]
    assert time[True, "balanced"] < time[False, "balanced"]
    assert simulate(layers, net, "wfbp").iteration_s < time[True, "balanced"]  # K-FAC costs extra


@pytest.mark.slow
def test_factor_buckets_planned_by_the_cost_model():
    params, tx, mesh = _params(), optax.sgd(0.1), _mesh(2)
    sched = jaxsched.schedule(_step(mesh, tx), strategy="kfac", network_profile="1gbe")
    sched(sched.init(params, tx.init(params)), steps.shard_batch(_batches(1)[0], mesh))
    assert sched.strategy.factor_buckets(sched.program.planned) == [[1, 0]]  # latency-bound: merged


def test_pmap_steps_are_refused_with_the_way_out():
    params, tx = _params(), optax.sgd(0.1)

    def body(params, opt_state, batch):
        x, y = batch
        grads = lax.pmean(jax.grad(lambda p: steps.cross_entropy(_apply(p, x), y))(params), "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ()

    devices = jax.devices()[:2]
    sched = jaxsched.schedule(jax.pmap(body, axis_name="data", devices=devices), strategy="kfac")
    state = sched.init(steps.replicate(params, 2), steps.replicate(tx.init(params), 2))
    with pytest.raises(jaxsched.UnsupportedStepError, match="kfac schedules jax.shard_map steps"):
        sched(state, steps.split_batch(_batches(1)[0], 2))
