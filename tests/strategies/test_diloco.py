"""DiLoCo and Streaming DiLoCo (``strategy="diloco"``) and the low-bit ``Quantize`` compressor.

Every result is checked against an independent reference: the plain data-parallel step
(H=1, one fragment, outer SGD at lr 1 is exactly a data-parallel SGD step), or a
hand-written jnp simulation of the streaming algorithm on a tiny model, one replica at a
time on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsched
from jaxsched.demo import steps
from jaxsched.runtime.collectives import BucketSpec
from jaxsched.runtime.compress import Quantize, bytes_sent
from jaxsched.runtime.compress._quantize import _pack4, _unpack4, dequantize, quantize
from jaxsched.strategies import DiLoCo
from jaxsched.strategies._diloco import fragment_of_leaves, sync_schedule

from support.equivalence import assert_trees_close, build, random_batches
from support.mesh_steps import run_plain_and_scheduled, two_level_step
from support.toolchains import needs_tpu

LR = 0.1


# -- exactness against the plain data-parallel step -----------------------------------------
def _one_axis_step(tx, devices=8):
    params, apply_fn = build("mlp", 0)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    step = steps.make_step(apply_fn, tx, mesh)

    def batches(n, seed=1, per_device=2):
        for x, y in random_batches("mlp", n, per_device * devices, seed):
            yield steps.shard_batch((jnp.asarray(x), jnp.asarray(y)), mesh)

    return step, params, tx.init(params), batches


def test_h1_equals_data_parallel_sgd_on_one_data_axis():
    made = _one_axis_step(optax.sgd(LR))
    plain, scheduled, plain_aux, sched_aux, _ = run_plain_and_scheduled(
        made, "diloco", steps=4, inner_steps=1, outer=optax.sgd(1.0)
    )
    assert_trees_close(scheduled, plain, rtol=1e-5)
    assert_trees_close(sched_aux, plain_aux, rtol=1e-5)


@pytest.mark.parametrize("sync_axes", [None, ("dcn", "ici"), "ici"])
def test_h1_equals_data_parallel_sgd_on_two_data_axes(sync_axes):
    made = two_level_step(2, 4, tx=optax.sgd(LR))
    plain, scheduled, plain_aux, sched_aux, sched = run_plain_and_scheduled(
        made, "diloco", steps=3, inner_steps=1, outer=optax.sgd(1.0), sync_axes=sync_axes
    )
    assert_trees_close(scheduled, plain, rtol=1e-5)
    assert_trees_close(sched_aux, plain_aux, rtol=1e-5)
    expected = ("dcn",) if sync_axes is None else tuple(np.atleast_1d(sync_axes))
    assert sched.strategy.sync_axes(sched.program.planned) == expected


def test_h1_equals_data_parallel_sgd_with_implicit_reductions_and_jit_steps():
    """check_vma=True (JAX sums the gradients in backward) and a jax.jit step on global
    arrays (jaxsched partitions it): the sums are found and restricted the same way."""
    made = two_level_step(2, 4, tx=optax.sgd(LR), check_vma=True)
    plain, scheduled, *_ = run_plain_and_scheduled(made, "diloco", steps=3, inner_steps=1, outer=optax.sgd(1.0))
    assert_trees_close(scheduled, plain, rtol=1e-5)
    params, apply_fn = build("mlp", 0)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = optax.sgd(LR)

    def batches(n, seed=1):
        for x, y in random_batches("mlp", n, 16, seed):
            yield steps.shard_batch((jnp.asarray(x), jnp.asarray(y)), mesh)

    plain, scheduled, *_ = run_plain_and_scheduled(
        (steps.make_jit_step(apply_fn, tx), params, tx.init(params), batches),
        "diloco",
        steps=3,
        inner_steps=1,
        outer=optax.sgd(1.0),
    )
    assert_trees_close(scheduled, plain, rtol=1e-5)


def test_without_communication_replicas_drift_apart_until_they_sync():
    """Between synchronizations the replicas differ; finalize right after a sync (F=1,
    α=0) is the global copy exactly, on every replica."""
    step, params, opt_state, batches = _one_axis_step(optax.sgd(LR))
    sched = jaxsched.schedule(step, strategy="diloco", inner_steps=3)
    state = sched.init(params, opt_state)
    data = list(batches(6))
    for b in data[:2]:
        state, _ = jax.block_until_ready(sched(state, b))
    w = np.asarray(jax.tree.leaves(state.params)[-1])
    assert not np.allclose(w[0], w[1])  # replicas trained on different data
    state, _ = sched(state, data[2])
    w = np.asarray(jax.tree.leaves(state.params)[-1])
    assert (w == w[:1]).all()  # synchronized after H steps
    final, _ = sched.finalize(state)
    for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(state.global_params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# -- the streaming algorithm against a hand-written reference -------------------------------
DIN, DOUT = 4, 3


def _tiny(mesh, axes, inner_tx):
    rng = np.random.default_rng(0)
    params = {
        "W": jnp.asarray(rng.standard_normal((DIN, DOUT)) * 0.5, jnp.float32),
        "b": jnp.asarray(rng.standard_normal(DOUT) * 0.1, jnp.float32),
        "s": jnp.ones(DOUT, jnp.float32),
    }

    def loss_fn(p, x, y):
        return jnp.mean(((x @ p["W"] + p["b"]) * p["s"] - y) ** 2)

    def local(p, o, batch):
        x, y = batch
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        g = lax.pmean(g, axes)
        updates, o = inner_tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, lax.pmean(loss, axes)

    step = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(axes)), out_specs=(P(), P(), P()), check_vma=False)
    )
    return step, params, loss_fn


def _reference(params, loss_fn, inner_tx, outer_tx, batches, replicas, H, F, tau, alpha, frag):
    """DiLoCo / Streaming DiLoCo written out directly: one replica at a time, one device."""
    keys = sorted(params)
    local = [dict(params) for _ in range(replicas)]
    inner = [inner_tx.init(params) for _ in range(replicas)]
    glob = dict(params)
    outer = [outer_tx.init({k: params[k] for k in keys if frag[k] == p}) for p in range(F)]
    offsets = [((p + 1) * H // F) % H for p in range(F)]
    in_flight = {}  # send time -> (fragment, mean outer gradient)

    def mean_delta(p):
        return {k: sum(glob[k] - local[r][k] for r in range(replicas)) / replicas for k in keys if frag[k] == p}

    def apply(p, delta):
        part = {k: glob[k] for k in delta}
        updates, outer[p] = outer_tx.update(delta, outer[p], part)
        for k, v in optax.apply_updates(part, updates).items():
            glob[k] = v
            for r in range(replicas):
                local[r][k] = alpha * local[r][k] + (1 - alpha) * v

    def due(s):
        return [p for p in range(F) if s >= 1 and s % H == offsets[p]]

    for t, (x, y) in enumerate(batches):
        if tau >= 1:
            for p in due(t):
                in_flight[t] = (p, mean_delta(p))
        xs, ys = np.split(x, replicas), np.split(y, replicas)
        for r in range(replicas):
            g = jax.grad(loss_fn)(local[r], xs[r], ys[r])
            updates, inner[r] = inner_tx.update(g, inner[r], local[r])
            local[r] = optax.apply_updates(local[r], updates)
        if tau == 0:
            for p in due(t + 1):
                apply(p, mean_delta(p))
        elif t + 1 - tau in in_flight:
            apply(*in_flight.pop(t + 1 - tau))
    for p, delta in in_flight.values():  # finalize: what is in flight arrives
        apply(p, delta)
    final = {k: glob[k] + sum(local[r][k] - glob[k] for r in range(replicas)) / replicas for k in keys}
    return final, glob


@pytest.mark.parametrize(
    "mesh_shape,H,F,tau,alpha,n_steps",
    [
        ((8,), 3, 1, 0, 0.0, 7),
        ((8,), 4, 2, 1, 0.0, 9),
        ((8,), 6, 2, 2, 0.3, 10),  # ends with a fragment in flight
        ((2, 4), 4, 2, 1, 0.0, 9),  # sync over 'dcn', inner sums over 'ici'
    ],
)
def test_streaming_diloco_matches_a_hand_written_reference(mesh_shape, H, F, tau, alpha, n_steps):
    axes = ("data",) if len(mesh_shape) == 1 else ("dcn", "ici")
    mesh = jax.make_mesh(mesh_shape, axes, devices=jax.devices()[:8])
    axis = axes[0] if len(axes) == 1 else axes
    inner_tx = optax.sgd(0.05, momentum=0.9)
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    step, params, loss_fn = _tiny(mesh, axis, inner_tx)
    # leaves W (12), b (3), s (3): two fragments cut after W
    assert fragment_of_leaves([12, 3, 3], 2) == (0, 1, 1)
    frag = {"W": 0, "b": F - 1, "s": F - 1}
    rng = np.random.default_rng(3)
    host = [
        (rng.standard_normal((16, DIN)).astype(np.float32), rng.standard_normal((16, DOUT)).astype(np.float32))
        for _ in range(n_steps)
    ]
    replicas = mesh_shape[0]
    want, want_glob = _reference(params, loss_fn, inner_tx, outer_tx, host, replicas, H, F, tau, alpha, frag)

    sched = jaxsched.schedule(
        step, strategy="diloco", inner_steps=H, fragments=F, overlap_steps=tau, mixing=alpha, outer=outer_tx
    )
    state = sched.init(params, inner_tx.init(params))
    for b in host:
        state, _ = sched(state, jax.device_put(b, NamedSharding(mesh, P(axis))))
        jax.block_until_ready(state)  # one multi-device step in flight (FACTS.md)
    assert int(state.step) == n_steps
    if tau < 2:  # with τ >= 2 the reference's global copy already has the in-flight fragment
        assert_trees_close(state.global_params, want_glob, rtol=1e-5, atol=1e-6)
    got, _ = sched.finalize(state)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "layout",
    [
        # FSDP inside each replica: W's rows split over 'fsdp', the replicas over 'data'; the
        # fragments balance each device's bytes, and a device holds 3 of W's 12 elements
        ((2, 4), ("data", "fsdp"), {"W": P("fsdp", None), "b": P(), "s": P()}, P(("data", "fsdp")), (0, 0, 1)),
        # a model axis inside each replica, which XLA partitions: W's rows split over 'model'
        ((4, 2), ("data", "model"), {"W": P("model", None), "b": P(), "s": P()}, P("data"), (0, 1, 1)),
    ],
    ids=["fsdp", "model"],
)
def test_streaming_diloco_on_sharded_parameters_matches_the_hand_written_reference(layout):
    """A ``jax.jit`` step whose parameters are split over an axis inside each replica: the
    replicas (over 'data') train and synchronize as the reference's, and every leaf comes
    back split as the plain step returns it."""
    shape, axes, specs, batch_spec, fragments = layout
    mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:8], axis_types=(jax.sharding.AxisType.Auto,) * 2)
    H, F, tau, n_steps = 4, 2, 1, 9
    inner_tx = optax.sgd(0.05, momentum=0.9)
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    _, params, loss_fn = _tiny(mesh, axes[0], inner_tx)

    @jax.jit
    def step(p, o, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, *batch)
        updates, o = inner_tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, loss

    frag = dict(zip(("W", "b", "s"), fragments))
    rng = np.random.default_rng(np.random.default_rng().integers(1 << 30))
    host = [
        (rng.standard_normal((16, DIN)).astype(np.float32), rng.standard_normal((16, DOUT)).astype(np.float32))
        for _ in range(n_steps)
    ]
    want, _ = _reference(params, loss_fn, inner_tx, outer_tx, host, shape[0], H, F, tau, 0.0, frag)
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    sched = jaxsched.schedule(
        step, strategy="diloco", inner_steps=H, fragments=F, overlap_steps=tau, outer=outer_tx, sync_axes="data"
    )
    state = sched.init(placed, inner_tx.init(placed))
    for b in host:
        state, _ = sched(state, jax.device_put(b, NamedSharding(mesh, batch_spec)))
        jax.block_until_ready(state)
    got, _ = sched.finalize(state)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    for k, leaf in got.items():
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), leaf.ndim), (k, leaf.sharding)


def test_fragments_and_schedule_helpers():
    assert sync_schedule(10, 4) == (2, 5, 7, 0)
    assert fragment_of_leaves([1, 1, 1, 1, 1, 1], 3) == (0, 0, 1, 1, 2, 2)
    assert fragment_of_leaves([100, 1, 1], 3) == (0, 1, 2)  # every fragment non-empty
    with pytest.raises(ValueError, match="fragments"):
        fragment_of_leaves([1, 1], 3)


def test_finalize_is_compiled_by_the_steps_engine():
    from jaxsched.runtime.engine import XlaEngine

    compiled = []

    class Recording(XlaEngine):
        def compile(self, program):
            compiled.append(program)
            return super().compile(program)

    step, params, opt_state, batches = _one_axis_step(optax.sgd(LR), devices=2)
    sched = jaxsched.schedule(step, strategy="diloco", inner_steps=2, engine=Recording())
    state = sched.init(params, opt_state)
    for batch in batches(3):
        state, _ = sched(state, batch)
    before = len(compiled)
    sched.finalize(state)
    assert len(compiled) == before + 1 and compiled[-1].compiler_defaults


# -- compressed outer gradients --------------------------------------------------------------
@pytest.mark.parametrize("size", [1000, 1024])  # the last block padded, or none
def test_quantize_packs_and_rounds_within_half_a_step(size):
    rng = np.random.default_rng(size)
    x = jnp.asarray(rng.standard_normal(size), jnp.float32)
    for bits in (4, 8):
        codes, scales = quantize(x, bits, 64)
        assert codes.shape == (-(-size // 64), 64)
        back = dequantize(codes, scales, size)
        assert back.shape == (size,)
        step = np.repeat(np.asarray(scales), 64)[:size]
        assert (np.abs(np.asarray(back - x)) <= step / 2 + 1e-7).all()
        assert np.abs(np.asarray(codes)).max() == 2 ** (bits - 1) - 1
    codes, _ = quantize(x, 4, 64)
    np.testing.assert_array_equal(np.asarray(_unpack4(_pack4(codes))), np.asarray(codes))


def test_quantized_sum_with_error_feedback_tracks_the_exact_sum():
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    q = Quantize(bits=8, block_size=32)
    spec = BucketSpec(0, 200, jnp.dtype("float32"), 4)

    def body(g, residual, sent):
        total, (own, _) = q.all_reduce(g[0], "data", spec, (q.init_own(spec)._replace(residual=residual[0]), ()))
        return total, own.residual[None], own.bytes_sent[None]

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=(P(), P("data"), P("data")), check_vma=False
        )
    )
    rng = np.random.default_rng(1)
    put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("data")))  # noqa: E731
    residual, sent = put(np.zeros((4, 200), np.float32)), put(np.zeros((4,), np.int32))
    exact_sum, approx_sum = np.zeros(200), np.zeros(200)
    for _ in range(5):
        g = rng.standard_normal((4, 200)).astype(np.float32)
        total, new_residual, sent = f(put(g), residual, sent)
        # one round: each device's rounding error is at most half its block's step
        x = g + np.asarray(residual)
        block_max = np.concatenate([np.abs(x), np.zeros((4, 24))], 1).reshape(4, -1, 32).max(-1) / 127
        bound = np.repeat(block_max, 32, 1)[:, :200].sum(0) / 2
        assert (np.abs(np.asarray(total) - x.sum(0)) <= bound + 1e-5).all()
        exact_sum += g.sum(0)
        approx_sum += np.asarray(total)
        residual = new_residual
    # error feedback: what was not sent is still held, so the running sums differ by it
    np.testing.assert_allclose(approx_sum + np.asarray(residual).sum(0), exact_sum, atol=1e-4)
    assert (np.asarray(sent) == q.payload_bytes(200)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_outer_update_is_within_one_quantization_step(bits):
    """The outer update with quantized outer gradients (error feedback on) differs from the
    full-precision one by no more than the quantization step of the outer gradients."""
    step, params, opt_state, batches = _one_axis_step(optax.sgd(LR), devices=4)
    data = list(batches(3))
    qmax = 2 ** (bits - 1) - 1
    results = {}
    for name, comp in (("full", None), ("quant", Quantize(bits=bits, block_size=64))):
        # H=2, τ=1: the outer gradients of the first sync are sent at the start of the
        # third step, from the local parameters the state holds after two
        sched = jaxsched.schedule(
            step, strategy="diloco", inner_steps=2, overlap_steps=1, outer=optax.sgd(1.0), compression=comp
        )
        state = sched.init(params, opt_state)
        for b in data[:2]:
            state, _ = sched(state, b)
        before = state
        state, _ = sched(state, data[2])
        results[name] = (before, state)
    before_full, after_full = results["full"]
    before_q, after_q = results["quant"]
    for a, b in zip(jax.tree.leaves(before_full.params), jax.tree.leaves(before_q.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the outer gradients every replica sends, and the largest quantization step among them
    deltas = [
        np.asarray(g)[None] - np.asarray(loc)
        for g, loc in zip(jax.tree.leaves(before_full.global_params), jax.tree.leaves(before_full.params))
    ]
    q_step = max(np.abs(d).max() for d in deltas) / qmax
    diffs = [
        np.abs(np.asarray(a) - np.asarray(b)).max()
        for a, b in zip(jax.tree.leaves(after_full.global_params), jax.tree.leaves(after_q.global_params))
    ]
    assert max(diffs) <= q_step, (diffs, q_step)
    assert max(diffs) > 0  # the outer gradients really were rounded
    assert (
        bytes_sent(after_q)
        == Quantize(bits=bits, block_size=64).payload_bytes(sum(p.size for p in jax.tree.leaves(params)))
    ).all()


def test_quantized_outer_sum_is_the_same_on_every_device_of_a_two_level_mesh():
    """With fast axes each device quantizes and sends its shard of every leaf over 'dcn';
    after the gather every device holds the same synchronized parameters."""
    step, params, opt_state, batches = two_level_step(2, 4, tx=optax.sgd(LR))
    sched = jaxsched.schedule(step, strategy="diloco", inner_steps=2, compression=Quantize(bits=4, block_size=16))
    state = sched.init(params, opt_state)
    for b in batches(2):
        state, _ = jax.block_until_ready(sched(state, b))
    for local, glob in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.global_params)):
        local = np.asarray(local)
        assert (local == local[:1]).all()
        np.testing.assert_array_equal(local[0], np.asarray(glob))
    # each device sent the 4-bit payload of its quarter (4 'ici' devices) of every leaf
    shard_sizes = [-(-p.size // 4) for p in jax.tree.leaves(params)]
    assert (bytes_sent(state) == Quantize(bits=4, block_size=16).payload_bytes(sum(shard_sizes))).all()


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options,match",
    [
        ({"inner_steps": 0}, "inner_steps"),
        ({"inner_steps": 4, "fragments": 2, "overlap_steps": 2}, "overlap_steps"),
        ({"inner_steps": 4, "fragments": 5}, "fragments"),
        ({"mixing": 1.0}, "mixing"),
        ({"inner_strategy": "dear"}, "dear shards the optimizer"),
        ({"inner_strategy": "approx"}, "inner_strategy"),
        ({"sync_axes": ()}, r"sync_axes=\(\)\) names no axis.*sync_axes='data'"),
    ],
)
def test_bad_options_are_refused_with_the_argument_named(options, match):
    with pytest.raises(ValueError, match=match):
        DiLoCo(**options)
    with pytest.raises(ValueError, match=match):
        jaxsched.schedule(lambda p, o, b: (p, o, ()), strategy="diloco", **options)


def test_sync_axes_must_be_data_axes():
    made = two_level_step(2, 4, tx=optax.sgd(LR))
    step, params, opt_state, batches = made
    sched = jaxsched.schedule(step, strategy="diloco", inner_steps=2, sync_axes="model")
    with pytest.raises(ValueError, match=r"sync_axes=\('model',\).*not among the step's data axes"):
        sched(sched.init(params, opt_state), next(batches(1)))


# -- state ------------------------------------------------------------------------------------
@pytest.mark.slow  # two schedules and an orbax round trip: make test-slow
def test_checkpoint_round_trip_continues_identically(tmp_path):
    from jaxsched.integrations import checkpoint

    step, params, opt_state, batches = _one_axis_step(optax.adam(1e-2), devices=4)
    data = list(batches(7))
    options = dict(inner_steps=4, fragments=2, overlap_steps=1, compression=Quantize(bits=4, block_size=32))
    sched = jaxsched.schedule(step, strategy="diloco", **options)
    state = sched.init(params, opt_state)
    for b in data[:3]:
        state, _ = sched(state, b)
    checkpoint.save(tmp_path / "ckpt", state)
    resumed_sched = jaxsched.schedule(step, strategy="diloco", **options)
    target = resumed_sched.init(params, opt_state, data[0])
    resumed = checkpoint.restore(tmp_path / "ckpt", target)
    for b in data[3:]:
        state, _ = jax.block_until_ready(sched(state, b))
        resumed, _ = jax.block_until_ready(resumed_sched(resumed, b))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_finalize_of_init_is_the_identity():
    step, params, opt_state, batches = _one_axis_step(optax.adam(1e-2), devices=4)
    sched = jaxsched.schedule(step, strategy="diloco", inner_steps=3)
    assert_trees_close(sched.finalize(sched.init(params, opt_state)), (params, opt_state), rtol=0)
    converted = sched.init(params, opt_state, next(batches(1)))
    got = sched.finalize(converted)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((params, opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- simulator ----------------------------------------------------------------------------------
def test_simulated_diloco_step_time():
    from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
    from jaxsched.sim import SimulationError, simulate
    from jaxsched.sim._diloco import simulate_diloco

    layers = LayerProfile([Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(4)])
    net = network_preset("10gbe", 8)
    compute = layers.forward_s + layers.backward_s + layers.update_s
    h1 = simulate_diloco(layers, net, inner_steps=1)
    # H=1, τ=0: every step is the compute, one all-reduce of every byte, the outer update
    assert h1.step_s == pytest.approx(compute + net.time("all_reduce", layers.total_bytes) + layers.update_s)
    h10 = simulate_diloco(layers, net, inner_steps=10)
    assert h10.step_s == pytest.approx(compute + (h1.step_s - compute) / 10)
    # with τ=1 and a fragment's all-reduce shorter than a step, nothing is exposed
    streaming = simulate_diloco(layers, net, inner_steps=10, fragments=2, overlap_steps=1)
    assert streaming.outer_s < compute
    assert streaming.step_s == pytest.approx(compute + layers.update_s / 10)
    assert simulate_diloco(layers, net, 10, outer_bits=4).slow_bytes_per_step < h10.slow_bytes_per_step / 7
    with pytest.raises(SimulationError, match="simulate_diloco"):
        simulate(layers, net, "diloco")
    with pytest.raises(SimulationError, match="overlap_steps"):
        simulate_diloco(layers, net, inner_steps=4, fragments=2, overlap_steps=2)


# -- the host engine (two processes) ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{"inner_steps": 4, "fragments": 2, "overlap_steps": 1}, {"inner_steps": 6, "fragments": 2, "overlap_steps": 2}],
)
def test_two_processes_host_engine_equals_xla_engine(tmp_path, options):
    """Every phase is its own program with the outer all-reduce at its top level, so the
    host engine stages it (a comm stage) beside the inner step's compute."""
    import io
    import json
    import os
    import sys

    from jaxsched.tools import launch as launch_lib

    from support import SUPPORT_DIR

    out = tmp_path / "report.json"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(SUPPORT_DIR.parent.parent), str(SUPPORT_DIR.parent)]),
    )
    log = io.StringIO()
    code = launch_lib.launch(
        2,
        [sys.executable, str(SUPPORT_DIR / "diloco_host_worker.py"), str(out), json.dumps(options)],
        env=env,
        stdout=log,
        stderr=log,
        timeout_s=300,
        grace_s=2,
    )
    assert code == 0, log.getvalue()[-4000:]
    report = json.loads(out.read_text())
    assert report["params_rel_gap"] < 1e-4, report
    np.testing.assert_allclose(report["losses"]["host"], report["losses"]["xla"], rtol=1e-5)
    import ast

    # phases that send (τ >= 1: the send is the first thing of the step's program)
    synced = [k for k in report["stages"] if ast.literal_eval(k)[0] is not None]
    assert synced and all(
        report["stages"][k].count("comm") > report["stages"]["(None, None)"].count("comm") for k in synced
    )


# -- the guide quotes the committed results ------------------------------------------------------
def test_the_guide_quotes_the_committed_benchmark_results():
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    guide = (root / "docs/diloco.md").read_text()
    conv = json.loads((root / "benchmarks/results/diloco_convergence.json").read_text())
    for name, run in conv["runs"].items():
        label = name.replace("tau=1", "τ=1")
        row = re.search(rf"^\| {re.escape(label)} \| ([\d.]+) ± ([\d.]+) \|", guide, re.M)
        assert row, name
        assert (float(row[1]), float(row[2])) == (round(run["test_loss_mean"], 4), round(run["test_loss_std"], 4)), name
    cluster = json.loads((root / "benchmarks/results/diloco_cluster.json").read_text())
    quoted = [float(x) for x in re.findall(r"^\| [^|]+ \| ([\d.]+) \| [\d.]+ \| [\d.]+ \|", guide, re.M)]
    measured = [round(v["mean_step_s"] * 1e3, 1) for v in cluster["variants"].values()]
    assert quoted == measured


def test_simulate_command_reports_diloco_as_simulated(tmp_path, capsys):
    import json

    from jaxsched.tools.cli import main
    from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
    from jaxsched.sim._diloco import simulate_diloco

    layers = LayerProfile([Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(6)])
    layers.save(tmp_path / "layers.json")
    out = tmp_path / "out.json"
    code = main(
        [
            "simulate",
            "--profile",
            str(tmp_path / "layers.json"),
            "--workers",
            "8",
            "--network",
            "10gbe",
            "--strategy",
            "allreduce,diloco",
            "--inner-steps",
            "10",
            "--fragments",
            "2",
            "--overlap-steps",
            "1",
            "--outer-bits",
            "4",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "SIMULATED" in table and "diloco" in table
    data = json.loads(out.read_text())
    want = simulate_diloco(layers, network_preset("10gbe", 8), 10, 2, 1, 4)
    assert data["simulated"] and data["strategies"]["diloco"]["simulated"]
    assert data["strategies"]["diloco"]["step_s"] == pytest.approx(want.step_s)


# -- compiled for two TPU slices (XLA:TPU, compile-only devices) ---------------------------------
@needs_tpu
def test_a_streaming_fragment_crosses_slices_during_the_inner_step_on_a_tpu_pod():
    """Two v5p slices, F=2, τ=1: in a phase that sends a fragment, its cross-slice transfers
    (XLA:TPU's host send/recv pairs) are asynchronous with the inner step's matmuls in their
    windows, and its mean comes back over the slice in the leaves' own layout: no flat
    all-gather that XLA must relayout after the arrival (estimated at 5 ms for a 4096x4096
    leaf, on the critical path)."""
    import dataclasses
    import re

    from jaxsched.check import _inspection as inspect_lib
    from jaxsched.tools.aot._experiment import ModelSpec, abstract_experiment, mesh_for

    mesh = mesh_for("v5p:2x2x2:slices=2", ("dcn", "ici"))
    exp = abstract_experiment(ModelSpec("mlp", (256,), 10, {"hidden": (512,) * 3}, batch_per_device=64), mesh=mesh)
    sched = jaxsched.schedule(exp.step, strategy="diloco", inner_steps=4, fragments=2, overlap_steps=1)
    state = sched.init(exp.params, exp.opt_state)
    sched.lower(state, exp.batch)
    program, strategy = sched.program, sched.program.strategy
    assert strategy.sync_axes(program.planned) == ("dcn",)

    def compiled_phase(key):
        body = strategy.rewrite_phase(program.planned, key)
        core = program.engine.compile(dataclasses.replace(program.per_device, body=body))
        compiled, schedule = inspect_lib.compile_with_schedule(core.lower(*program.inputs(state, exp.batch)))
        return compiled.as_text(), inspect_lib.report(compiled, schedule, mesh, label=repr(key))

    sender = strategy.phase_key(None)
    assert sender[0] is not None
    text, report = compiled_phase(sender)
    # the fragment's shards (a 512x512 leaf: 64 rows per 'ici' device), not the loss's scalar sum
    sends = [c for c in report.collectives if c.kind == "send" and c.bytes >= 64 * 512 * 4]
    assert sends, report.collectives
    for c in sends:
        assert c.is_async and c.compute_flops > 0, c  # inner-step matmuls in the window
    gathers = re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} all-gather\(", text)
    assert "512,512" in gathers and not [g for g in gathers if "," not in g and int(g or 1) >= 512 * 512], gathers
    # a phase that sends nothing moves no fragment across slices
    _, quiet = compiled_phase((None, None))
    assert not [c for c in quiet.collectives if c.kind == "send" and c.bytes >= 64 * 512 * 4], quiet.collectives
