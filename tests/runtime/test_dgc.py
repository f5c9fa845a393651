"""Deep Gradient Compression's options on TopK and GlobalTopK: warm-up tiers and
their bytes, momentum correction with factor masking against a NumPy reference, local
clipping, exactness at full density, checkpoints mid-warm-up, and bad input."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxsched
from jaxsched.integrations import checkpoint
from jaxsched.runtime import kernels
from jaxsched.demo import steps
from jaxsched.runtime.collectives import BucketSpec
from jaxsched.runtime.compress import GlobalTopK, TopK, bytes_sent
from support.equivalence import assert_trees_close, build, random_batches, run_both


def _mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _put(x, mesh):
    return jax.device_put(x, jax.NamedSharding(mesh, P("data")))


class _Collective:
    """One bucket of per-device buffers through ``compressor.all_reduce``, step after step,
    carrying the compressor's state (one row per device)."""

    def __init__(self, compressor, devices, n):
        self.mesh = _mesh(devices)
        self.spec = BucketSpec(0, n, jnp.dtype("float32"), devices, shapes=((n,),))
        own, self.inner = compressor.init([self.spec])[0]
        leaves, self.treedef = jax.tree.flatten(own)
        self.state = [_put(np.broadcast_to(np.asarray(x), (devices,) + np.shape(x)).copy(), self.mesh) for x in leaves]

        def body(g, *state):
            mine = jax.tree.unflatten(self.treedef, [s[0] for s in state])
            out, (new, _) = compressor.all_reduce(g[0], "data", self.spec, (mine, self.inner))
            return (out[None],) + tuple(x[None] for x in jax.tree.leaves(new))

        self.fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False))

    def __call__(self, grads):
        out, *self.state = self.fn(_put(grads, self.mesh), *self.state)
        return np.asarray(out)

    @property
    def own(self):
        return jax.tree.unflatten(self.treedef, [np.asarray(x) for x in self.state])

    def hlo(self, grads):
        return self.fn.lower(_put(grads, self.mesh), *self.state).as_text()


# -- the schedule ---------------------------------------------------------------------------
def test_warmup_decays_exponentially_in_tiers_to_the_target_density():
    topk = TopK(0.01, warmup_steps=90)
    levels = topk.density_levels()
    assert len(levels) == 4 and levels[0] == 0.25 and levels[-1] == 0.01
    np.testing.assert_allclose(np.diff(np.log(levels)), np.log(0.04) / 3)  # one ratio: exponential
    densities = [topk.density_at(s) for s in range(120)]
    assert densities[:30] == [0.25] * 30 and densities[90:] == [0.01] * 30
    assert all(a >= b for a, b in zip(densities, densities[1:]))
    assert topk.mean_density(90) == pytest.approx(np.mean(levels[:3]))
    assert topk.mean_density(300) == pytest.approx((30 * sum(levels[:3]) + 210 * 0.01) / 300)
    # the simulator and the planners: steady state by default, a step or a run on request
    assert topk.sim_compression().density == 0.01
    assert topk.sim_compression(step=0).density == 0.25
    assert topk.sim_compression(steps=300).density == pytest.approx(topk.mean_density(300))
    assert TopK(0.01).density_levels() == (0.01,) and TopK(0.01).mean_density(50) == 0.01
    assert TopK(0.01, warmup_steps=10, warmup_tiers=5).density_levels()[1] == pytest.approx(0.25 * 0.04**0.2)
    assert len(TopK(0.01, warmup_steps=2, warmup_tiers=5).density_levels()) == 3  # at most one per step
    assert GlobalTopK(0.5, warmup_steps=10).density_levels() == (0.5,)  # 25 % is sparser: no warm-up
    # a density per bucket: each bucket decays from the same start to its own target
    lags = TopK((1.0, 0.01), warmup_steps=10)
    specs = [BucketSpec(i, 100, jnp.dtype("float32"), 2) for i in range(2)]
    assert lags.density_levels(specs[0]) == (1.0,) and lags.density_at(0, specs[1]) == 0.25
    with pytest.raises(ValueError, match="pass the bucket"):
        lags.density_at(0)
    from jaxsched.pipeline._selection import simulated_compression
    from jaxsched.strategies import make_strategy

    assert simulated_compression(make_strategy("wfbp", collective=topk)).density == 0.01


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TopK(0.01, warmup_steps=-1), r"TopK\(warmup_steps=-1\): warmup_steps must be an int >= 0"),
        (lambda: TopK(0.01, warmup_steps=2.5), r"warmup_steps must be an int >= 0"),
        (
            lambda: GlobalTopK(0.1, warmup_steps=10, warmup_density=0.05),
            r"GlobalTopK\(density=0.1, warmup_density=0.05\).*give warmup_density >= density",
        ),
        (lambda: TopK(0.01, warmup_steps=10, warmup_density=1.5), r"warmup_density must be in \(0, 1\]"),
        (lambda: TopK(0.01, warmup_density=0.3), r"warmup_steps=0 turns it off; give warmup_steps > 0"),
        (lambda: TopK(0.01, warmup_steps=10, warmup_tiers=0), r"warmup_tiers must be an int >= 1"),
        (lambda: TopK(0.01, momentum=1.0), r"TopK\(momentum=1.0\): momentum must be in \[0, 1\).*optax.sgd"),
        (lambda: TopK(0.01, momentum=-0.1), r"momentum must be in \[0, 1\)"),
        (lambda: TopK(0.01, momentum="high"), r"momentum must be a number"),
        (
            lambda: GlobalTopK(0.01, error_feedback=False, momentum=0.9),
            r"GlobalTopK\(momentum=0.9, error_feedback=False\).*use error_feedback=True, or momentum=0",
        ),
        (lambda: TopK(0.01, clip_norm=0.0), r"TopK\(clip_norm=0.0\): clip_norm must be a finite number > 0"),
        (lambda: TopK(0.01, clip_norm=True), r"clip_norm must be a number > 0, or None"),
    ],
)
def test_bad_dgc_options_are_refused_at_construction_naming_the_argument(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_existing_positional_arguments_keep_their_meaning():
    topk = TopK(0.05, False, "exact", 3)
    assert (topk.density, topk.error_feedback, topk.selection, topk.seed) == (0.05, False, "exact", 3)
    assert GlobalTopK(0.05, False).error_feedback is False
    assert repr(TopK(0.01, warmup_steps=50, momentum=0.9)) == (
        "TopK(density=0.01, error_feedback=True, warmup_steps=50, warmup_density=0.25, "
        "momentum=0.9, selection='threshold')"
    )
    with pytest.raises(TypeError):
        TopK(0.01, True, "exact", 0, None, 100)  # the new options are keyword-only


# -- warm-up: bytes and buffers --------------------------------------------------------------
@pytest.mark.parametrize("selection", ["exact", "threshold"])
def test_bytes_sent_follow_the_warmup_schedule_and_end_at_the_target(selection):
    n, devices = 20_000, 2
    topk = TopK(0.01, selection=selection, warmup_steps=6, warmup_density=0.16, warmup_tiers=2)
    assert [round(d, 4) for d in topk.density_levels()] == [0.16, 0.04, 0.01]
    run = _Collective(topk, devices, n)
    rng = np.random.default_rng(0)
    sent = []
    for s in range(9):
        run(rng.standard_normal((devices, n)).astype(np.float32))
        own = run.own
        np.testing.assert_array_equal(own.step, s + 1)
        np.testing.assert_array_equal(own.bytes_sent, 8 * own.selected)
        k = kernels.selection_size(n, topk.density_at(s))
        if selection == "exact":
            np.testing.assert_array_equal(own.selected, k)
        else:  # the sampled threshold lands near k, within that tier's capacity
            assert np.all(np.abs(own.selected - k) <= 0.2 * k)
            assert np.all(own.selected <= topk.capacity(run.spec, topk.density_at(s)))
        sent.append(int(own.bytes_sent[0]))
    assert sent[0] > sent[3] > sent[6]
    assert sent[:3] == sorted(sent[:3], reverse=True) or selection == "threshold"
    # after warm-up the step moves what the compressor without warm-up moves
    plain = TopK(0.01, selection=selection)
    assert topk.capacity(run.spec) == plain.capacity(run.spec)
    if selection == "exact":
        assert sent[6:] == [8 * kernels.selection_size(n, 0.01)] * 3


def test_each_tier_has_its_own_static_all_gather_and_the_last_is_the_plain_one():
    n, devices = 20_000, 2
    grads = np.zeros((devices, n), np.float32)
    warm = TopK(0.01, selection="exact", warmup_steps=6, warmup_density=0.16, warmup_tiers=2)
    plain = TopK(0.01, selection="exact")
    warm_hlo, plain_hlo = _Collective(warm, devices, n).hlo(grads), _Collective(plain, devices, n).hlo(grads)
    gathers = lambda hlo: sorted(set(re.findall(r"all_gather.*?->\s*tensor<(\d+)xf32>", hlo)), key=int)
    assert gathers(plain_hlo) == [str(devices * 200)]
    assert gathers(warm_hlo) == [str(devices * k) for k in (200, 800, 3200)]
    assert "case" in warm_hlo and "case" not in plain_hlo


# -- momentum correction, by hand --------------------------------------------------------------
def _reference(grads_per_step, k, momentum, global_topk=False, clip_norm=None):
    """DGC on each device in NumPy: u = m u + g; v += u; send top-k of v; zero u, v there."""
    devices, n = grads_per_step[0].shape
    u = np.zeros((devices, n), np.float32)
    v = np.zeros((devices, n), np.float32)
    totals = []
    for g in grads_per_step:
        if clip_norm is not None:
            norms = np.sqrt(np.sum(g.astype(np.float32) ** 2, axis=1, keepdims=True))
            g = (g * np.minimum(1.0, clip_norm / norms)).astype(np.float32)
        u = (np.float32(momentum) * u + g).astype(np.float32)
        v = (v + u).astype(np.float32)
        tops = [np.argsort(-np.abs(v[d]), kind="stable")[:k] for d in range(devices)]
        if global_topk:  # 2 devices: one merge of the two sparse vectors, then the top k
            merged = np.zeros(n, np.float32)
            for d in range(devices):
                merged[tops[d]] += v[d, tops[d]]
            chosen = np.argsort(-np.abs(merged), kind="stable")[:k]
            tops = [chosen] * devices
        total = np.zeros(n, np.float32)
        for d in range(devices):
            total[tops[d]] += v[d, tops[d]]
            v[d, tops[d]] = 0
            u[d, tops[d]] = 0
        totals.append(total)
    return totals, v, u


@pytest.mark.parametrize("kind", ["topk", "gtopk"])
@pytest.mark.parametrize("clip_norm", [None, 5.0])
def test_momentum_correction_matches_a_numpy_reference(kind, clip_norm):
    n, devices, k, m = 64, 2, 4, 0.9
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal((devices, n)).astype(np.float32) for _ in range(3)]
    if kind == "topk":
        comp = TopK(k / n, selection="exact", momentum=m, clip_norm=clip_norm)
    else:
        comp = GlobalTopK(k / n, momentum=m, clip_norm=clip_norm)
    run = _Collective(comp, devices, n)
    totals, residual, velocity = _reference(grads, k, m, global_topk=kind == "gtopk", clip_norm=clip_norm)
    for g, expected in zip(grads, totals):
        out = run(g)
        for d in range(devices):
            np.testing.assert_allclose(out[d], expected, rtol=1e-6, atol=1e-6)
    own = run.own
    np.testing.assert_allclose(own.residual, residual, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(own.velocity, velocity, rtol=1e-6, atol=1e-6)
    assert np.count_nonzero(own.velocity) > n  # momentum is carried where nothing was sent
    sent_now = totals[-1] != 0 if kind == "gtopk" else None
    if sent_now is not None:  # gTop-k masks the agreed indices on every device
        assert np.all(own.velocity[:, sent_now] == 0)


def test_clipping_bounds_each_devices_contribution():
    n, devices = 256, 2
    big = np.full((devices, n), 10.0, np.float32)  # norm 160 per device
    run = _Collective(TopK(1.0, clip_norm=1.0), devices, n)
    out = run(big)
    np.testing.assert_allclose(np.linalg.norm(out[0]), 2.0, rtol=1e-5)  # two clipped copies
    assert TopK(0.01).init_velocity(run.spec) == ()  # no array to carry (or to checkpoint)
    assert TopK(0.01, momentum=0.5).init_velocity(run.spec).shape == (n,)


# -- density 1.0 is the dense step; checkpoints mid-warm-up ------------------------------------
# Scheduled steps on 8 devices compile for seconds: two cases run in `make test`, the rest in
# `make test-slow` (CI runs both).
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "compression, tx",
    [
        pytest.param(TopK(1.0), optax.sgd(0.1, momentum=0.9), marks=SLOW),
        pytest.param(TopK(1.0, warmup_steps=4), optax.sgd(0.1, momentum=0.9), marks=SLOW),
        (TopK(1.0, selection="exact", momentum=0.9), optax.sgd(0.1)),  # masking clears the velocity
        pytest.param(GlobalTopK(1.0, warmup_steps=4, momentum=0.9), optax.sgd(0.1), marks=SLOW),
        # a warm-up tier at density 1 goes through lax.switch inside the scheduled step
        (
            TopK(0.02, selection="exact", warmup_steps=12, warmup_density=1.0, warmup_tiers=1),
            optax.sgd(0.1, momentum=0.9),
        ),
    ],
    ids=["topk", "topk_warmup", "topk_momentum", "gtopk_warmup_momentum", "topk_dense_tier"],
)
def test_full_density_is_the_dense_step(compression, tx):
    plain, sched, plain_aux, sched_aux, s = run_both(
        "mlp", tx, "wfbp", 8, n_steps=6, buckets=2000, compression=compression
    )
    assert_trees_close(sched, plain, rtol=1e-5, atol=1e-6)
    assert_trees_close(sched_aux, plain_aux, rtol=1e-5, atol=1e-6)


@SLOW
@pytest.mark.parametrize(
    "strategy, compression",
    [
        ("wfbp", TopK(0.05, warmup_steps=4, warmup_tiers=2, momentum=0.9)),
        ("dear", GlobalTopK(0.05, warmup_steps=4, warmup_tiers=2, momentum=0.9)),
    ],
)
def test_a_checkpoint_mid_warmup_resumes_bit_identically(tmp_path, strategy, compression):
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.05)
    mesh = _mesh(8)
    step = steps.make_step(apply_fn, tx, mesh)
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", 7, 16, 5)]
    sched = jaxsched.schedule(step, strategy=strategy, compression=compression)
    state = sched.init(params, tx.init(params))
    sent = []
    for b in batches[:3]:  # step 3 of 4 warm-up steps: the second tier
        state, _ = sched(state, b)
        sent.append(int(bytes_sent(jax.block_until_ready(state))[0]))
    velocities = [own.velocity for own, _ in state.collective_state]
    assert any(float(jnp.max(jnp.abs(v))) > 0 for v in velocities)
    checkpoint.save(tmp_path / "ckpt", state)
    uninterrupted = state
    for b in batches[3:]:
        uninterrupted, _ = sched(uninterrupted, b)
        sent.append(int(bytes_sent(jax.block_until_ready(uninterrupted))[0]))
    assert sent[0] == sent[1] > sent[2] == sent[3] > sent[4] == sent[5] == sent[6]

    resumed = jaxsched.schedule(step, strategy=strategy, compression=compression)
    restored = checkpoint.restore(tmp_path / "ckpt", resumed.init(params, tx.init(params), batches[0]))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for b in batches[3:]:
        restored, _ = resumed(restored, b)
        jax.block_until_ready(restored)
    for a, b in zip(jax.tree.leaves(uninterrupted), jax.tree.leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_host_engine_refuses_a_warmup_step_and_names_the_xla_engine():
    """Warm-up switches between all-gathers of different sizes inside lax.switch; the host
    engine stages top-level collectives only, so it says so instead of running it."""
    from jaxsched.runtime.engine import PerDeviceProgram
    from jaxsched.runtime.engine._host import HostEngineError, cut_stages

    mesh = _mesh(2)
    spec = BucketSpec(0, 64, jnp.dtype("float32"), 2, shapes=((64,),))
    for comp, refused in ((TopK(0.05, warmup_steps=4), True), (TopK(0.05, momentum=0.9), False)):
        state = comp.init([spec])[0]

        def body(g, comp=comp, state=state):
            return (comp.all_reduce(g, "data", spec, state)[0],)

        program = PerDeviceProgram(body, mesh, "data", (P("data"),), (P(),))
        jaxpr, _ = program.jaxpr_and_operands(jnp.zeros(128))
        if refused:
            with pytest.raises(HostEngineError, match=r"all_gather inside (cond|switch).*engine='xla'"):
                cut_stages(jaxpr)
        else:
            assert any(stage.kind == "comm" for stage in cut_stages(jaxpr))
