"""data parallelism over several mesh axes, beside model axes, and Hierarchical.

Every exact strategy must equal the user's plain step (rtol 1e-5, fresh random inputs) on
2-D meshes: ``('data', 'model')`` with a tensor-parallel MLP, and ``('dcn', 'ici')`` data
parallel over both axes, with and without ``check_vma``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxsched
import jaxsched.tools.aot
from jaxsched.core._capture import UnsupportedStepError
from jaxsched.runtime.collectives import BucketSpec, Hierarchical, hierarchy_from_mesh, slow_axes
from jaxsched.runtime.collectives._hierarchical import default_collective_for
from jaxsched.runtime.compress import TopK, bytes_sent

from support.equivalence import assert_trees_close
from support.mesh_steps import run_plain_and_scheduled, tensor_parallel_mlp, two_level_step
from support.toolchains import needs_gpu, needs_tpu

EXACT = [
    ("allreduce", {}),
    ("wfbp", {}),
    ("wfbp", {"buckets": 1}),
    ("dear", {}),
    ("dear", {"buckets": 1}),
    ("approx", {"staleness": 0, "buckets": 1}),
]
#: what `make test` runs; `make test-slow` runs every strategy on every mesh
FAST = {("wfbp", False), ("dear", True), ("approx", False)}


def _matrix(meshes):
    """(mesh, strategy, options, check_vma) cases, the FAST ones unmarked, the rest slow."""
    cases = []
    for mesh in meshes:
        for strategy, options in EXACT:
            for check_vma in (False, True):
                fast = (strategy, check_vma) in FAST and mesh == meshes[0] and "buckets" in options
                marks = () if fast else (pytest.mark.slow,)
                cases.append(
                    pytest.param(
                        mesh,
                        strategy,
                        options,
                        check_vma,
                        marks=marks,
                        id=f"{mesh[0]}x{mesh[1]}-{strategy}-{options}-vma{check_vma}",
                    )
                )
    return cases


def _check(made, strategy, options):
    plain, scheduled, plain_aux, sched_aux, sched = run_plain_and_scheduled(made, strategy, **options)
    assert_trees_close(scheduled, plain, rtol=1e-5)
    assert_trees_close(sched_aux, plain_aux, rtol=1e-5)
    return sched


@pytest.mark.parametrize("mesh,strategy,options,check_vma", _matrix([(2, 4), (4, 2), (2, 2)]))
def test_tensor_parallel_step_is_scheduled_over_the_data_axis(mesh, strategy, options, check_vma):
    sched = _check(tensor_parallel_mlp(*mesh, check_vma), strategy, options)
    assert sched.program.captured.axis_name == "data"
    assert sched.program.captured.axis_size == mesh[0]


@pytest.mark.parametrize("mesh,strategy,options,check_vma", _matrix([(2, 4), (4, 2), (2, 2)]))
def test_data_parallel_over_two_axes(mesh, strategy, options, check_vma):
    sched = _check(two_level_step(*mesh, check_vma=check_vma), strategy, options)
    assert sched.program.captured.axis_name == ("dcn", "ici")
    assert sched.program.captured.axis_size == mesh[0] * mesh[1]


@pytest.mark.parametrize(
    "strategy,options",
    [
        pytest.param("wfbp", {}, marks=pytest.mark.slow),
        pytest.param("dear", {}, marks=pytest.mark.slow),
        ("dear", {"buckets": 1}),
        pytest.param("approx", {"staleness": 0, "buckets": 1}, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("axes", [("dcn", "ici"), ("ici", "dcn")])
def test_hierarchical_collective_is_exact(strategy, options, axes):
    made = two_level_step(2, 4, axes=("dcn", "ici"))
    if axes != ("dcn", "ici"):  # the batch names the axes in the other order
        made = two_level_step(4, 2, axes=axes)
    _check(made, strategy, dict(options, collective=Hierarchical(fast="ici", slow="dcn")))


def test_dear_shards_its_optimizer_over_both_axes():
    sched = _check(two_level_step(2, 4), "dear", {})
    state = sched.init(*two_level_step(2, 4)[1:3], next(two_level_step(2, 4)[3](1)))
    kernel = jax.tree.leaves(state.opt_state)[1]
    assert kernel.sharding.spec == P(("dcn", "ici"))
    assert len({str(s.index) for s in kernel.addressable_shards}) == 8  # eight different pieces


def test_dear_updates_a_tensor_parallel_block_sharded_over_data():
    made = tensor_parallel_mlp(4, 2)
    sched = _check(made, "dear", {})
    # the replicated bias is sharded over 'data'; the model-sharded blocks keep their spec
    specs = sched.program.rewritten.state_in_specs
    assert P("data") in specs and P(None, "model") in specs


def _hier_case(axes, fast_size, slow_size, n):
    mesh = jax.make_mesh(
        (slow_size, fast_size) if axes[0] == "dcn" else (fast_size, slow_size),
        axes,
        devices=jax.devices()[: fast_size * slow_size],
    )
    mesh_axes = tuple((a, mesh.shape[a]) for a in axes)
    return mesh, mesh_axes


@pytest.mark.parametrize("axes", [("dcn", "ici"), ("ici", "dcn")])
@pytest.mark.parametrize("fast_size,slow_size", [(4, 2), (2, 4), (2, 2)])
def test_hierarchical_matches_the_flat_collectives(axes, fast_size, slow_size):
    mesh, mesh_axes = _hier_case(axes, fast_size, slow_size, 0)
    p = fast_size * slow_size
    chunk = 3
    spec = BucketSpec(0, p * chunk, jnp.dtype("float32"), p, interleaved=True, mesh_axes=mesh_axes)
    odd = BucketSpec(1, p * chunk - 1, jnp.dtype("float32"), p, mesh_axes=mesh_axes)
    hier = Hierarchical(fast="ici", slow="dcn")
    state, odd_state = hier.init([spec, odd])

    def body(x):
        flat_rs = lax.psum_scatter(x, axes, tiled=True)
        rs, _ = hier.reduce_scatter(x, axes, spec, state)
        ag, _ = hier.all_gather(flat_rs, axes, spec, state)
        ar, _ = hier.all_reduce(x[:-1], axes, odd, odd_state)
        return (
            rs[None],
            flat_rs[None],
            ag[None],
            lax.all_gather(flat_rs, axes, tiled=True)[None],
            ar[None],
            lax.psum(x[:-1], axes)[None],
        )

    f = jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False)
    x = np.random.default_rng(p).standard_normal(p * p * chunk).astype(np.float32)
    rs, flat_rs, ag, flat_ag, ar, flat_ar = f(jax.device_put(x, jax.NamedSharding(mesh, P(axes))))
    np.testing.assert_allclose(rs, flat_rs, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ag, flat_ag)
    np.testing.assert_allclose(ar, flat_ar, rtol=1e-5, atol=1e-6)


def test_compression_only_on_the_slow_axis():
    # density 1: every entry crosses the slow axis, so the sum is exact
    _check(
        two_level_step(2, 4),
        "wfbp",
        {"compression": Hierarchical("ici", "dcn", slow_collective=TopK(1.0, selection="exact"))},
    )
    step, params, opt_state, batches = two_level_step(2, 4)
    sched = jaxsched.schedule(
        step, strategy="wfbp", buckets=10**9, compression=Hierarchical("ici", "dcn", slow_collective=TopK(0.1))
    )
    state, _ = sched(sched.init(params, opt_state), next(batches(1)))
    # each device's residual is its fast group's quarter of the bucket
    size = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))
    ((own, _),) = sched.program.strategy.collective_template(sched.program.planned)
    assert own.residual.shape == (-(-size // 4),)
    sent = bytes_sent(state)  # only the slow axis's sparse payload: about 10% of the quarter
    assert sent.shape == (8,) and 0 < sent.max() < 0.25 * 8 * own.residual.shape[0]


def test_the_mixed_axes_step_is_no_longer_refused_with_a_wrong_message():
    step, params, opt_state, batches = tensor_parallel_mlp(4, 2)
    sched = jaxsched.schedule(step, strategy="wfbp")
    sched(sched.init(params, opt_state), next(batches(1)))  # used to raise "reduced over several"


def test_a_gradient_reduction_over_a_model_axis_says_which_axes():
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    tx = optax.sgd(0.1)
    params = {"w": jnp.ones((3, 2))}

    def local(params, opt_state, batch):
        grads = jax.grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
        grads = lax.pmean(grads, ("data", "model"))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ()

    step = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )
    sched = jaxsched.schedule(step, strategy="wfbp")
    batch = jax.device_put(jnp.ones((8, 3)), jax.NamedSharding(mesh, P("data")))
    with pytest.raises(
        UnsupportedStepError,
        match=r"reduced over axes \('data', 'model'\).*"
        r"\('model',\) are not data-parallel axes",
    ):
        sched(sched.init(params, tx.init(params)), batch)


def test_hierarchical_refuses_a_step_on_other_axes():
    from support.equivalence import run_both

    with pytest.raises(
        ValueError,
        match=r"needs a step whose data-parallel axes are exactly "
        r"\('dcn', 'ici'\).*this step's are \('data',\)",
    ):
        run_both("mlp", optax.sgd(0.1), "wfbp", 4, n_steps=1, collective=Hierarchical("ici", "dcn"))


def test_hierarchical_checks_its_arguments():
    with pytest.raises(ValueError, match="both fast and slow"):
        Hierarchical(fast="x", slow=("x", "y"))
    with pytest.raises(TypeError, match="slow_collective"):
        Hierarchical(slow_collective="topk")
    with pytest.raises(TypeError, match="mesh axis name"):
        Hierarchical(fast="")


def test_kfac_refuses_model_sharded_params_by_name():
    step, params, opt_state, batches = tensor_parallel_mlp(4, 2)
    sched = jaxsched.schedule(step, strategy="kfac")
    with pytest.raises(UnsupportedStepError, match=r"params/b1 is sharded over the model axes \('model',\)"):
        sched(sched.init(params, opt_state), next(batches(1)))


@needs_tpu
@needs_gpu
def test_the_mesh_names_the_slow_axis():
    aot = jaxsched.tools.aot
    devices = aot.devices("v5p", "2x2x2", slices=2)
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 8), ("dcn", "ici"))
    assert slow_axes(mesh, ("dcn", "ici")) == ("dcn",)
    chosen = hierarchy_from_mesh(mesh, ("dcn", "ici"))
    assert (chosen.fast, chosen.slow) == (("ici",), ("dcn",))
    # XLA:TPU lowers the flat sum over slices in two levels itself: left to it by default
    assert default_collective_for(mesh, ("dcn", "ici")) is None
    hosts = jax.sharding.Mesh(np.array(aot.devices("h100", "1x2x4")).reshape(2, 4), ("hosts", "local"))
    assert (default_collective_for(hosts, ("hosts", "local")).slow) == ("hosts",)
    # virtual CPU devices of one process name no slow axis: the flat sum stays
    local = jax.make_mesh((2, 4), ("dcn", "ici"), devices=jax.devices()[:8])
    assert slow_axes(local, ("dcn", "ici")) == () and hierarchy_from_mesh(local, ("dcn", "ici")) is None


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True)  # the same meshes in every CI run
@given(
    first=st.sampled_from([1, 2, 4]),
    second=st.sampled_from([1, 2, 4]),
    strategy=st.sampled_from(["wfbp", "dear"]),
    tensor_parallel=st.booleans(),
)
def test_any_mesh_shape_within_eight_devices(first, second, strategy, tensor_parallel):
    if first * second > 8:
        return
    made = tensor_parallel_mlp(first, second) if tensor_parallel else two_level_step(first, second)
    options = {"buckets": 1}
    if not tensor_parallel and strategy == "dear" and first > 1 and second > 1:
        options["collective"] = Hierarchical(fast="ici", slow="dcn")
    _check(made, strategy, options)


def test_a_trainstate_step_over_two_axes_with_the_hierarchy():
    import flax.linen as nn
    from flax.training import train_state

    mesh = jax.make_mesh((2, 4), ("dcn", "ici"), devices=jax.devices()[:8])
    axes = ("dcn", "ici")

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))

    model = Mlp()
    start = train_state.TrainState.create(
        apply_fn=model.apply, tx=optax.adam(1e-2), params=model.init(jax.random.key(0), jnp.ones((1, 5)))["params"]
    )

    def local(state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
        return state.apply_gradients(grads=lax.pmean(grads, axes)), lax.pmean(loss, axes)

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axes)), out_specs=(P(), P()), check_vma=False))
    rng = np.random.default_rng(3)
    batches = [
        jax.device_put(
            (rng.standard_normal((16, 5)).astype(np.float32), rng.standard_normal((16, 3)).astype(np.float32)),
            jax.NamedSharding(mesh, P(axes)),
        )
        for _ in range(3)
    ]
    plain = start
    for b in batches:
        plain, _ = step(plain, b)
    sched = jaxsched.schedule(step, strategy="dear", collective=Hierarchical(fast="ici", slow="dcn"))
    state = sched.init(start)
    for b in batches:
        state, _ = sched(state, b)
    final = sched.finalize(state)
    assert isinstance(final, train_state.TrainState) and int(final.step) == 3
    assert_trees_close(final.params, plain.params, rtol=1e-5)
    assert_trees_close(final.opt_state, plain.opt_state, rtol=1e-5)


def test_verify_runs_a_tensor_parallel_step_in_float64():
    step, params, opt_state, batches = tensor_parallel_mlp(4, 2)
    sched = jaxsched.schedule(step, strategy="dear")
    report = sched.verify(sched.init(params, opt_state), list(batches(3)), steps=3)
    assert report.ok and report.precision == "float64"


def test_a_sum_level_by_level_by_hand_is_refused_with_what_to_write():
    mesh = jax.make_mesh((2, 4), ("dcn", "ici"), devices=jax.devices()[:8])
    tx = optax.sgd(0.1)

    def local(params, opt_state, batch):
        grads = jax.grad(lambda p: jnp.sum((batch @ p["w"]) ** 2))(params)
        grads = lax.psum(lax.psum(grads, "ici"), "dcn")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ()

    step = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(), P(("dcn", "ici"))), out_specs=(P(), P(), P()), check_vma=False
        )
    )
    sched = jaxsched.schedule(step, strategy="wfbp")
    params = {"w": jnp.ones((3, 2))}
    batch = jax.device_put(jnp.ones((8, 3)), jax.NamedSharding(mesh, P(("dcn", "ici"))))
    with pytest.raises(
        UnsupportedStepError,
        match=r"in separate calls \(over \('dcn',\), \('ici',\)\); "
        r"reduce them in one, lax.pmean\(grads, \('dcn', 'ici'\)\)",
    ):
        sched(sched.init(params, tx.init(params)), batch)


@pytest.mark.slow
@pytest.mark.parametrize("strategy,options", [("dear", {}), ("approx", {"staleness": 0})])
@pytest.mark.parametrize("slow_collective", [TopK(1.0, selection="exact"), "gtopk"])
def test_a_full_density_compressor_on_the_slow_axis_is_exact(strategy, options, slow_collective):
    from jaxsched.runtime.compress import GlobalTopK

    slow_collective = GlobalTopK(1.0) if slow_collective == "gtopk" else slow_collective
    _check(
        two_level_step(2, 4),
        strategy,
        dict(options, compression=Hierarchical("ici", "dcn", slow_collective=slow_collective)),
    )
