"""`jax.jit` steps whose parameters are sharded (FSDP, HSDP, tensor parallelism): every exact
strategy equals the plain jit step on fresh random inputs (rtol 1e-5), returns every leaf with
the user's sharding, and keeps no more state per device than the plain step; what cannot be
made exact is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsched
import support.sharded_steps as ss
from jaxsched.core._axes import as_axes
from support.hlo_counts import collectives
from support.toolchains import needs_gpu, needs_tpu

EXACT = {"allreduce": {}, "wfbp": {}, "dear": {}}


def _copy(tree):
    return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else np.array(a), tree)


def _assert_like_plain(got, want, rtol=1e-5, atol=1e-6):
    """Same structure, and per leaf the same shape, dtype, sharding and (within rtol) values."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        if isinstance(b, jax.Array) and len(b.sharding.device_set) > 1:
            assert isinstance(a, jax.Array) and a.sharding.is_equivalent_to(b.sharding, b.ndim), (
                a.sharding,
                b.sharding,
            )
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _run(step, params, opt_state, batches, strategy, mesh_context=None, **options):
    """Plain and scheduled side by side; returns the schedule, its last state and both ends."""
    import contextlib

    with mesh_context or contextlib.nullcontext():
        plain, plain_aux = (_copy(params), _copy(opt_state)), []
        for b in batches:
            *plain, aux = step(*plain, b)
            plain_aux.append(aux)
        sched = jaxsched.schedule(step, strategy=strategy, **options)
        state, sched_aux = sched.init(_copy(params), _copy(opt_state)), []
        for b in batches:
            state, aux = sched(state, b)
            sched_aux.append(jax.block_until_ready(aux))
        final = sched.finalize(state)
    _assert_like_plain(final, tuple(plain))
    _assert_like_plain(sched_aux, plain_aux)
    return sched, state, tuple(plain)


def _mlp_case(layout_name, tx, seed, dropout=False):
    layout = ss.LAYOUTS[layout_name]
    mesh = layout.mesh()
    params = ss.place(mesh, ss.params_for(seed), layout.params)
    batches = ss.batches(mesh, layout.batch, 3, seed + 1)
    if dropout:
        keys = [jax.random.key(seed + k) for k in range(3)]
        batches = [(x, y, k) for (x, y), k in zip(batches, keys)]
    return layout, mesh, params, tx.init(params), batches


#: every layout under every exact strategy; make test runs a spread of them, make test-slow all
FAST = {("fsdp", "allreduce"), ("fsdp", "wfbp"), ("fsdp", "dear"), ("hsdp", "wfbp"), ("hsdp", "dear")}
FAST |= {("tensor_explicit", "dear"), ("tensor_fsdp", "wfbp"), ("unit_axes", "dear")}
CASES = [
    pytest.param(layout, strategy, marks=[] if (layout, strategy) in FAST else [pytest.mark.slow])
    for layout in ("fsdp", "hsdp", "tensor", "tensor_explicit", "tensor_fsdp", "unit_axes")
    for strategy in EXACT
]


@pytest.mark.parametrize("layout_name, strategy", CASES)
def test_sharded_parameters_equal_the_plain_jit_step(layout_name, strategy):
    """adamw behind a global-norm clip: the norm of parameter blocks sums over the data axes."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    seed = hash(layout_name) % 1000
    layout, mesh, params, opt_state, batches = _mlp_case(layout_name, tx, seed)
    step = ss.mlp_step(tx, layout, mesh)
    sched, state, plain = _run(step, params, opt_state, batches, strategy, layout.context(mesh))
    # FSDP keeps what it is for: no more state on a device than the plain step holds
    assert ss.state_bytes((state.params, state.opt_state)) <= ss.state_bytes(plain)
    captured = sched.program.captured
    assert captured.kind == "jit"
    batch_axes = set(as_axes(layout.batch[0]))
    assert set(as_axes(captured.axis_name)) == {a for a in batch_axes if mesh.shape[a] > 1}


@pytest.mark.parametrize("layout_name, strategy", [("fsdp", "wfbp"), ("hsdp", "dear")])
def test_moments_initialised_unplaced_are_kept_sharded_like_their_parameters(layout_name, strategy):
    """``jax.jit(tx.init)(params)`` leaves the moments on one device (host arrays do the
    same); the plain step returns them sharded like their parameters, and so does the
    scheduled one, holding no more on a device than the plain step."""
    tx = optax.adamw(1e-2)
    layout, mesh, params, _, batches = _mlp_case(layout_name, tx, 11)
    opt_state = jax.jit(tx.init)(params)
    mu = opt_state[0].mu["w1"]
    assert not isinstance(mu.sharding, NamedSharding) or mu.sharding.is_fully_replicated
    _, state, plain = _run(ss.mlp_step(tx, layout, mesh), params, opt_state, batches, strategy)
    assert not plain[1][0].mu["w1"].sharding.is_fully_replicated  # the plain step shards it
    assert ss.state_bytes((state.params, state.opt_state)) <= ss.state_bytes(plain)


@pytest.mark.parametrize("layout_name", ["fsdp", "hsdp"])
def test_inspect_reads_a_state_that_holds_an_uncommitted_leaf(layout_name):
    """``optax.adam(...).init`` leaves its ``count`` uncommitted on the default device;
    ``jax.jit`` moves such a leaf where the step needs it, and so must the compiles behind
    ``inspect`` (the scheduled step's and the plain baseline's)."""
    tx = optax.adam(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case(layout_name, tx, 13)
    assert not opt_state[0].count.committed
    sched = jaxsched.schedule(ss.mlp_step(tx, layout, mesh), strategy="wfbp")
    state = sched.init(params, opt_state)
    inspection = sched.inspect(state, batches[0])
    assert inspection.baseline is not None
    kinds = {w.kind for w in inspection.report.collectives}
    assert "reduce-scatter" in kinds or "all-reduce" in kinds
    state, _ = sched(state, batches[0])  # and the step still runs on it
    jax.block_until_ready(state)


@pytest.mark.parametrize("strategy", ["wfbp", pytest.param("dear", marks=pytest.mark.slow)])
def test_the_jits_out_shardings_place_the_state_as_the_plain_step_returns_it(strategy):
    """A jit whose ``out_shardings`` differ from the inputs' placement: the scheduled state
    keeps the layout the plain step returns, not the one the inputs came in."""
    tx = optax.sgd(0.1, momentum=0.9)
    layout, mesh, params, _, batches = _mlp_case("fsdp", tx, 12)
    out_specs = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P()}
    out = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs)
    plain_step = ss.mlp_step(tx, layout, mesh)
    step = jax.jit(plain_step.__wrapped__, out_shardings=(out, (optax.TraceState(out), optax.EmptyState()), None))
    opt_state = tx.init(params)
    _, state, plain = _run(step, params, opt_state, batches, strategy)
    assert plain[0]["w1"].sharding.spec == P(None, "fsdp")


def _step_returning(tx, mesh, constrain=None, grads_in_aux=False):
    """A two-layer step whose new parameters pass through ``with_sharding_constraint(.,
    constrain)`` and whose aux holds the gradients when asked."""

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        if constrain is not None:
            new = jax.lax.with_sharding_constraint(new, jax.tree.map(lambda s: NamedSharding(mesh, s), constrain))
        return new, opt_state, {"loss": loss, **({"grads": grads} if grads_in_aux else {})}

    return step


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
@pytest.mark.parametrize("given, returned", [("replicated", "fsdp"), ("fsdp", "replicated")])
def test_an_in_step_sharding_constraint_places_the_state_as_the_plain_step_returns_it(strategy, given, returned):
    """The step lays out its new parameters with ``lax.with_sharding_constraint`` (here
    another layout than the inputs'): the scheduled state keeps that layout, as the plain
    step returns it (``_run`` compares every leaf's sharding)."""
    specs = {"replicated": {"w1": P(), "w2": P()}, "fsdp": {"w1": P("fsdp", None), "w2": P("fsdp", None)}}
    tx = optax.sgd(0.1, momentum=0.9)
    layout = ss.LAYOUTS["fsdp"]
    mesh = layout.mesh()
    params = ss.place(mesh, {k: v for k, v in ss.params_for(14).items() if k in ("w1", "w2")}, specs[given])
    batches = ss.batches(mesh, layout.batch, 3, 15)
    step = _step_returning(tx, mesh, constrain=specs[returned])
    _, state, plain = _run(step, params, tx.init(params), batches, strategy)
    assert plain[0]["w1"].sharding.is_equivalent_to(NamedSharding(mesh, specs[returned]["w1"]), 2)
    assert state.params["w1"].sharding.is_equivalent_to(plain[0]["w1"].sharding, 2)


@pytest.mark.parametrize("layout_name", ["fsdp", "tensor"])
@pytest.mark.parametrize("strategy", ["allreduce", "wfbp", "dear"])
def test_gradients_returned_in_aux_are_laid_out_as_their_parameters(strategy, layout_name):
    """The plain step returns an FSDP parameter's gradient in its parameter's blocks (the
    reduce-scatter the update reads); so does the scheduled step, from the same
    reduce-scatter, rather than summing the whole gradient onto every device. A tensor-
    parallel gradient stays split over the model axis as XLA's propagation splits it, also
    where the strategy packs gradients into buckets (dear), which leaves XLA nothing to
    propagate from."""
    tx = optax.adam(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case(layout_name, tx, 16)
    params = {k: params[k] for k in ("w1", "w2")}
    step = _step_returning(tx, mesh, grads_in_aux=True)
    plain_aux = step(_copy(params), tx.init(params), batches[0])[2]
    sched = jaxsched.schedule(step, strategy=strategy)
    _, aux = sched(sched.init(_copy(params), tx.init(params)), batches[0])
    for name in ("w1", "w2"):
        want, got = plain_aux["grads"][name], aux["grads"][name]
        assert not want.sharding.is_fully_replicated
        assert got.sharding.is_equivalent_to(want.sharding, want.ndim), (name, got.sharding, want.sharding)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layout_name, strategy", [("fsdp", "wfbp"), ("hsdp", "dear"), ("tensor", "dear")])
def test_a_partial_sum_returned_in_aux_is_placed_as_the_plain_step_returns_it(layout_name, strategy):
    """The row and column sums of a gradient and an update are partial sums the update does not read:
    the scheduled step sums them whole, and returns them where XLA places the plain step's
    (split over the data or model axis); ``_run`` compares every aux leaf's sharding."""
    tx = optax.adam(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case(layout_name, tx, 18)

    def sums(grads, updates):
        return {**{f"grad_{k}": (grads[k].sum(0), grads[k].sum(1)) for k in ("w1", "w2")}, "up": updates["w2"].sum(1)}

    step = _biased_mlp_step(tx, ("w1", "b1", "w2"), sums)
    plain_aux = step(_copy(params), _copy(opt_state), batches[0])[2]
    assert not all(a.sharding.is_fully_replicated for a in jax.tree.leaves(plain_aux))
    _run(step, params, opt_state, batches, strategy)


@pytest.mark.parametrize(
    "make_tx",
    [lambda: optax.MultiSteps(optax.adam(1e-2), 2), lambda: optax.apply_if_finite(optax.adam(1e-2), 3)],
    ids=["multisteps", "apply_if_finite"],
)
def test_dear_runs_a_conditional_update_over_blocks_and_a_replicated_leaf_on_shards(make_tx):
    """``MultiSteps``' and ``apply_if_finite``'s ``lax.cond`` takes the FSDP blocks of ``w1``,
    ``w2`` and dear's chunks of the replicated ``b1`` together. The blocks differ across
    devices by position, which the analysis follows into the branches: nothing combines
    them with a chunk there, so nothing is gathered (this fell back before, all-gathering
    the chunks for the whole conditional)."""
    import warnings

    tx = make_tx()
    layout, mesh, params, opt_state, batches = _mlp_case("fsdp", tx, 19)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsched.FallbackWarning)
        sched, _, _ = _run(ss.mlp_step(tx, layout, mesh), params, opt_state, batches, "dear")
    assert all(report.on_shards for report in sched.program.bucket_report)


def _biased_mlp_step(tx, names=("w0", "b0", "w1"), metrics=None):
    """Two layers with a bias between them (``names``), as a plain ``jax.jit`` step; its aux
    also holds ``metrics(grads, updates)``."""
    first, bias, second = names

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch
        loss_fn = lambda p: jnp.mean((jnp.tanh(x @ p[first] + p[bias]) @ p[second] - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        aux = {"loss": loss, **(metrics(grads, updates) if metrics else {})}
        return optax.apply_updates(params, updates), opt_state, aux

    return step


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_finalize_places_a_replicated_bias_as_xla_returns_it(strategy):
    """Kernels split over ``fsdp``, a bias replicated: XLA's propagation returns the plain
    step's new bias split over ``fsdp`` (it reduce-scatters the bias's gradient), which no
    input or annotation says; ``finalize`` reads it from the compiled plain step."""
    mesh = ss.LAYOUTS["fsdp"].mesh()
    rng = np.random.default_rng(17)
    specs = {"w0": P("fsdp", None), "b0": P(), "w1": P("fsdp", None)}
    shapes = {"w0": (64, 64), "b0": (64,), "w1": (64, 64)}
    params = {
        k: jax.device_put(rng.normal(size=s).astype(np.float32) * 0.3, NamedSharding(mesh, specs[k]))
        for k, s in shapes.items()
    }
    tx = optax.adam(1e-2)

    step = _biased_mlp_step(tx)

    batches = [
        jax.device_put(
            tuple(rng.normal(size=(32, 64)).astype(np.float32) for _ in range(2)), NamedSharding(mesh, P("fsdp"))
        )
        for _ in range(2)
    ]
    _, _, plain = _run(step, params, tx.init(params), batches, strategy)  # every leaf's sharding compared
    assert not plain[0]["b0"].sharding.is_fully_replicated


def test_a_batch_placed_over_other_data_axes_is_refused_naming_the_placement():
    """dear lays its state out over the data axes: a later batch over fewer of them gets an
    error about the batch's placement, not about the state's origin."""
    tx = optax.adam(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case("hsdp", tx, 13)
    sched = jaxsched.schedule(ss.mlp_step(tx, layout, mesh), strategy="dear")
    state, _ = sched(sched.init(params, opt_state), batches[0])
    other = jax.device_put(jax.device_get(batches[1]), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"placed over the data axes 'data'.*Place every batch over the same axes"):
        sched(state, other)
    state, _ = sched(state, batches[1])  # the state is still good for its own placement


def test_fsdp_gradients_are_reduce_scattered_in_backward_under_wfbp():
    tx = optax.adamw(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case("fsdp", tx, 3)
    sched, _, _ = _run(ss.mlp_step(tx, layout, mesh), params, opt_state, batches, "wfbp")
    analysis = sched.program.planned.analysis
    scattered = sorted((r.scatter_axes, tuple(r.result.aval.shape)) for r in analysis.reductions if r.scattered)
    assert scattered == [(("fsdp",), (2, 32)), (("fsdp",), (4, 8))]  # w1 and w2: their blocks
    # the scheduled program issues them in backward, bucketed, before the update
    jaxpr = sched.program.per_device.jaxpr(
        *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves((params, opt_state, batches[0]))]
    )
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names.count("reduce_scatter") == 2 and "all_gather" in names


def test_hsdp_sums_the_blocks_over_the_replica_axis_only():
    tx = optax.sgd(0.1, momentum=0.9)
    layout, mesh, params, opt_state, batches = _mlp_case("hsdp", tx, 5)
    sched, _, _ = _run(ss.mlp_step(tx, layout, mesh), params, opt_state, batches, "wfbp")
    forms = {(r.scatter_axes, r.sum_axes) for r in sched.program.planned.analysis.reductions}
    assert forms == {((), None), (("fsdp",), ("data",))}


@pytest.mark.parametrize("strategy", ["wfbp", "dear", pytest.param("allreduce", marks=pytest.mark.slow)])
def test_a_scanned_rematerialised_fsdp_stack(strategy):
    mesh = ss.LAYOUTS["fsdp"].mesh()
    tx = optax.adamw(1e-2)
    params = ss.scanned_params(mesh, seed=7)
    batches = ss.batches(mesh, P("fsdp"), 3, 8)
    sched, state, plain = _run(ss.scanned_step(tx), params, tx.init(params), batches, strategy)
    from jaxsched.core._replay import nested_eqns

    kept = {e.primitive.name for e in nested_eqns(sched.program.captured.body)}
    assert {"scan", "remat2"} <= kept
    assert ss.state_bytes((state.params, state.opt_state)) <= ss.state_bytes(plain)


@pytest.mark.parametrize("strategy", ["wfbp", "dear", "auto"])
def test_a_step_whose_every_parameter_is_in_the_scanned_stack(strategy):
    """No parameter outside the loop: every gradient is scattered into its layer's block
    inside its own iteration, none is left at the top level, and the step runs as
    partitioned (it was refused as if no gradient depended on the batch)."""
    mesh = ss.LAYOUTS["fsdp"].mesh()
    tx = optax.adam(1e-2)
    params = ss.scanned_params(mesh, seed=9, head=False)
    batches = ss.batches(mesh, P("fsdp"), 3, 10)
    sched, state, plain = _run(ss.scanned_step(tx), params, tx.init(params), batches, strategy)
    assert not sched.program.planned.analysis.reductions
    from jaxsched.core._replay import nested_eqns

    body = sched.program.captured.body
    top = {e.primitive.name for e in body.eqns}
    assert "reduce_scatter" in {e.primitive.name for e in nested_eqns(body)} and "reduce_scatter" not in top
    assert ss.state_bytes((state.params, state.opt_state)) <= ss.state_bytes(plain)


@pytest.mark.parametrize("strategy", ["dear", pytest.param("wfbp", marks=pytest.mark.slow)])
def test_dropout_bits_match_the_plain_step_on_sharded_parameters(strategy):
    tx = optax.adam(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case("hsdp", tx, 11, dropout=True)
    _run(ss.mlp_step(tx, layout, mesh, dropout=True), params, opt_state, batches, strategy)


def test_in_shardings_place_the_parameters_when_the_arrays_do_not():
    layout = ss.LAYOUTS["fsdp"]
    mesh = layout.mesh()
    tx = optax.sgd(0.1)
    host = ss.params_for(13)
    placed = ss.place(mesh, host, layout.params)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.params)
    opt_shardings = jax.tree.map(lambda a: a.sharding, tx.init(placed))
    step = ss.mlp_step(tx, layout, mesh)
    jitted = jax.jit(
        step.__wrapped__ if hasattr(step, "__wrapped__") else step,
        in_shardings=(shardings, opt_shardings, NamedSharding(mesh, layout.batch)),
    )
    batches = ss.batches(mesh, layout.batch, 2, 14)
    plain = jitted(placed, tx.init(placed), batches[0])
    sched = jaxsched.schedule(jitted, strategy="wfbp")
    state, _ = sched(sched.init(host, tx.init(host)), batches[0])
    got = sched.finalize(state)
    _assert_like_plain(got, (plain[0], plain[1]))
    assert sched.program.planned.captured.in_specs[:3] == (P(), P("fsdp"), P("fsdp"))  # b1, w1, w2


@pytest.mark.parametrize(
    "strategy, options", [("approx", {"staleness": 0}), pytest.param("auto", {}, marks=pytest.mark.slow)]
)
def test_the_other_exact_strategies_run_fsdp_steps(strategy, options):
    tx = optax.adam(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case("hsdp", tx, 17)
    _run(ss.mlp_step(tx, layout, mesh), params, opt_state, batches, strategy, **options)


@pytest.mark.parametrize("layout_name", ["tensor", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_approx_delays_a_sharded_steps_gradient_by_one_step_and_finalize_applies_it(layout_name):
    """``approx`` (``stale``, staleness 1) on sharded parameters against the delayed recurrence
    written with the plain step: with sgd an update is the plain step's change of the
    parameters it was computed at. ``finalize`` compiles a program of its own, which must
    leave the model axes to XLA as the step's does."""
    tx = optax.sgd(0.1)
    layout, mesh, params, _, batches = _mlp_case(layout_name, tx, 23)
    step = ss.mlp_step(tx, layout, mesh)
    change = lambda at, b: jax.tree.map(jnp.subtract, step(at, tx.init(at), b)[0], at)
    plus = lambda p, u: jax.tree.map(jnp.add, p, u)
    p0 = _copy(params)
    u1, u2 = change(p0, batches[0]), change(p0, batches[1])  # both at θ0: nothing applied yet
    p1 = plus(p0, u1)
    u3 = change(p1, batches[2])
    want = plus(plus(p1, u2), u3)  # finalize applies the pending g3

    sched = jaxsched.schedule(step, strategy="approx", approx_method="stale", staleness=1)
    state = sched.init(_copy(params), tx.init(params))
    losses = []
    for b in batches:
        state, aux = sched(state, b)
        losses.append(float(aux["loss"]))
    got, _ = sched.finalize(state)
    _assert_like_plain(got, want)
    plain_losses = [float(step(at, tx.init(at), b)[2]["loss"]) for at, b in zip((p0, p0, p1), batches)]
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)


@pytest.mark.parametrize("optimizer, levels", [("clip", 1), ("lamb", 2)])
@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_the_norms_of_parameter_blocks_are_one_all_reduce_per_level(strategy, optimizer, levels):
    """A global-norm clip sums each block's squares over the data axes, LAMB each leaf's two
    norms (the second masked by the first): independent sums go in one all-reduce, so a
    step holds one scalar vector per level of dependent sums, plus the loss."""
    tx = {
        "clip": optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2)),
        "lamb": optax.lamb(1e-2),
    }[optimizer]
    layout, mesh, params, opt_state, batches = _mlp_case("hsdp", tx, 23)
    sched, state, _ = _run(ss.mlp_step(tx, layout, mesh), params, opt_state, batches, strategy)
    text = sched.lower(state, batches[0]).as_text()
    scalars = [n for n in collectives(text)["all_reduce"] if n < ss.HIDDEN]
    assert len(scalars) <= levels + 1, scalars


@pytest.mark.parametrize("strategy", ["wfbp", pytest.param("dear", marks=pytest.mark.slow)])
def test_a_bfloat16_gradient_summed_beside_a_model_axis_compiles_on_cpu(strategy):
    """XLA:CPU aborted the process compiling a bfloat16 psum in a shard_map manual over the
    data axis only (the tensor axis left to XLA); the engine now leaves that sum in bfloat16."""
    layout = ss.LAYOUTS["tensor"]
    mesh = layout.mesh()
    tx = optax.sgd(0.05, momentum=0.9)
    raw = ss.params_for(4)
    raw["b1"] = raw["b1"].astype(jnp.bfloat16)
    params = ss.place(mesh, raw, layout.params)
    batches = ss.batches(mesh, layout.batch, 3, 5)
    step = ss.mlp_step(tx, layout, mesh)
    plain = (_copy(params), tx.init(params))
    for b in batches:
        *plain, _ = step(*plain, b)
    sched = jaxsched.schedule(step, strategy=strategy)
    state = sched.init(_copy(params), tx.init(params))
    for b in batches:
        state, _ = sched(state, b)
    got, _ = sched.finalize(state)
    assert got["b1"].dtype == jnp.bfloat16 and got["b1"].sharding.spec == plain[0]["b1"].sharding.spec
    for name in got:  # bfloat16 sums a rounding apart (its spacing near 0.1 is 2**-11)
        np.testing.assert_allclose(np.asarray(got[name], np.float32), np.asarray(plain[0][name], np.float32), atol=2e-3)


# -- refusals ------------------------------------------------------------------------------
def test_approx_local_refuses_a_clip_over_parameter_blocks_naming_the_optimizer_line():
    """The sum of a global norm over an FSDP parameter's blocks is a collective the update
    needs; the refusal names the line that asked for it (optax's norm), not jaxsched's."""
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1e-2))
    layout, mesh, params, opt_state, batches = _mlp_case("fsdp", tx, 3)
    sched = jaxsched.schedule(ss.mlp_step(tx, layout, mesh), strategy="approx", approx_method="local")
    with pytest.raises(jaxsched.UnsupportedStepError, match=r"communicates \(psum at .*optax.*\)") as refused:
        sched(sched.init(params, opt_state), batches[0])
    assert "jaxsched" not in str(refused.value).split("communicates (")[1].split(")")[0]


@pytest.mark.parametrize("head", [True, False])
def test_approx_refuses_a_scanned_fsdp_stack_naming_the_loop(head):
    """A scanned FSDP stack's gradients come out of its backward loop, already scattered:
    the refusal names that loop (with a head outside it, not the head's backward, which
    only feeds the loop)."""
    mesh = ss.LAYOUTS["fsdp"].mesh()
    tx = optax.sgd(0.1)
    params = ss.scanned_params(mesh, seed=5, head=head)
    sched = jaxsched.schedule(ss.scanned_step(tx), strategy="approx")
    with pytest.raises(jaxsched.UnsupportedStepError, match=r"the loop scan at .*sharded_steps.py") as refused:
        sched(sched.init(params, tx.init(params)), ss.batches(mesh, P("fsdp"), 1, 6)[0])
    assert "Unroll the stack" in str(refused.value)


def _refused(layout, params_specs, match):
    mesh = layout.mesh()
    tx = optax.sgd(0.1)
    params = ss.place(mesh, ss.params_for(0), params_specs)
    sched = jaxsched.schedule(ss.mlp_step(tx, layout, mesh), strategy="wfbp")
    with pytest.raises(jaxsched.UnsupportedStepError, match=match):
        sched(sched.init(params, tx.init(params)), ss.batches(mesh, layout.batch, 1, 0)[0])


def test_a_parameter_split_over_the_data_axes_along_two_dimensions_is_refused():
    layout = ss.LAYOUTS["hsdp"]
    _refused(
        layout,
        {"w1": P("data", "fsdp"), "b1": P(), "w2": P()},
        r"params\['w1'\] is sharded with P\('data', 'fsdp'\): over the data axes \('data', 'fsdp'\) along 2 dimensions",
    )


def test_a_dimension_over_data_and_model_axes_is_refused():
    layout = ss.LAYOUTS["tensor"]
    _refused(
        layout,
        {"w1": P(("data", "tensor"), None), "b1": P(), "w2": P()},
        r"params\['w1'\] is sharded with P\(\('data', 'tensor'\),\): its dimension 0 mixes the data axes",
    )


def test_kfac_refuses_sharded_parameters_by_name():
    tx = optax.sgd(0.1)
    layout, mesh, params, opt_state, batches = _mlp_case("fsdp", tx, 1)
    sched = jaxsched.schedule(ss.mlp_step(tx, layout, mesh), strategy="kfac")
    with pytest.raises(jaxsched.UnsupportedStepError, match=r"kfac .*params/w1.*sharded over \('fsdp',\)"):
        sched(sched.init(params, opt_state), batches[0])


# -- DiLoCo across 'data' with FSDP inside each replica -------------------------------------
@pytest.mark.parametrize("options", [{}, pytest.param({"fragments": 2, "overlap_steps": 1}, marks=pytest.mark.slow)])
def test_diloco_over_the_replica_axis_leaves_the_inner_fsdp_step_untouched(options):
    """H=1 with outer SGD at lr 1 (or fragments applied one step late, H=4) and momentum-free
    inner SGD: with H=1 exactly data-parallel SGD over every device; the parameters keep
    their FSDP blocks through the replicas, the synchronization and finalize."""
    tx = optax.sgd(0.1)
    layout, mesh, params, opt_state, batches = _mlp_case("hsdp", tx, 19)
    step = ss.mlp_step(tx, layout, mesh)
    if not options:
        _run(step, params, opt_state, batches, "diloco", sync_axes=("data",), inner_steps=1, outer=optax.sgd(1.0))
        return
    sched = jaxsched.schedule(step, strategy="diloco", sync_axes="data", inner_steps=4, outer=optax.sgd(1.0), **options)
    state = sched.init(_copy(params), _copy(opt_state))
    for b in batches * 3:
        state, _ = sched(state, b)
    got, _ = sched.finalize(state)
    for name, spec in layout.params.items():
        assert got[name].sharding.is_equivalent_to(NamedSharding(mesh, spec), got[name].ndim)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got))


def test_diloco_refuses_a_parameter_split_over_the_synchronised_axis():
    tx = optax.sgd(0.1)
    layout, mesh, params, opt_state, batches = _mlp_case("hsdp", tx, 1)
    sched = jaxsched.schedule(ss.mlp_step(tx, layout, mesh), strategy="diloco", sync_axes="fsdp", inner_steps=2)
    with pytest.raises(jaxsched.UnsupportedStepError, match=r"params/w1 is sharded over \('fsdp',\), one of them"):
        sched(sched.init(params, opt_state), batches[0])


# -- everything else works on these steps ------------------------------------------------------
@pytest.mark.parametrize("strategy", ["dear", pytest.param("wfbp", marks=pytest.mark.slow)])
def test_verify_passes_on_an_hsdp_step(strategy):
    tx = optax.adamw(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case("hsdp", tx, 23)
    sched = jaxsched.schedule(ss.mlp_step(tx, layout, mesh), strategy=strategy)
    report = sched.verify(sched.init(params, opt_state), batches, steps=3)
    assert report.ok, str(report)


@pytest.mark.parametrize("strategy", ["dear", pytest.param("wfbp", marks=pytest.mark.slow)])
def test_a_checkpoint_of_the_sharded_state_restores_and_continues_equal(strategy, tmp_path):
    from jaxsched.integrations.checkpoint import restore, save

    tx = optax.adam(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case("fsdp", tx, 29)
    batches = batches + ss.batches(mesh, layout.batch, 1, 30)
    step = ss.mlp_step(tx, layout, mesh)
    sched = jaxsched.schedule(step, strategy=strategy)
    straight = sched.init(_copy(params), _copy(opt_state))
    for b in batches:
        straight, _ = sched(straight, b)
    half = sched.init(_copy(params), _copy(opt_state))
    for b in batches[:2]:
        half, _ = sched(half, b)
    save(tmp_path / "ckpt", half)
    resumed_sched = jaxsched.schedule(step, strategy=strategy)
    resumed = restore(tmp_path / "ckpt", resumed_sched.init(params, opt_state, batches[0]))
    for leaf in jax.tree.leaves(resumed.params):  # restored as the blocks they were saved as
        assert len(leaf.sharding.device_set) == 8
    for b in batches[2:]:
        resumed, _ = resumed_sched(resumed, b)
    for a, b in zip(jax.tree.leaves(resumed_sched.finalize(resumed)), jax.tree.leaves(sched.finalize(straight))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("strategy", ["dear", "approx"])
def test_a_checkpoint_restored_into_a_target_built_without_a_batch_says_to_pass_one(tmp_path, strategy):
    """dear's state takes its structure from the program (its collective state), approx's
    holds a pending count no step has made an array yet; a target from
    ``sched.init(params, opt_state)`` alone has neither, which orbax refuses with a
    suggestion of a partial restore, or a raw type error. The refusal says how to build
    the target instead."""
    from jaxsched.integrations.checkpoint import restore, save

    tx = optax.adam(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case("fsdp", tx, 31)
    sched = jaxsched.schedule(ss.mlp_step(tx, layout, mesh), strategy=strategy)
    state, _ = sched(sched.init(_copy(params), _copy(opt_state)), batches[0])
    save(tmp_path / "ckpt", state)
    fresh = jaxsched.schedule(ss.mlp_step(tx, layout, mesh), strategy=strategy)
    with pytest.raises(
        jaxsched.JaxschedValueError, match=r"another structure.*sched\.init\(params, opt_state, example_batch\)"
    ):
        restore(tmp_path / "ckpt", fresh.init(_copy(params), _copy(opt_state)))


@pytest.mark.slow
def test_replan_on_an_fsdp_step_keeps_the_numbers():
    """buckets planned for the measured network, then re-planned for a 1 GbE one mid-run:
    every step equals the plain step's, before and after the switch."""
    tx = optax.sgd(0.1, momentum=0.9)
    layout, mesh, params, opt_state, batches = _mlp_case("fsdp", tx, 31)
    batches = batches + ss.batches(mesh, layout.batch, 3, 32)
    step = ss.mlp_step(tx, layout, mesh)
    sched = jaxsched.schedule(step, strategy="wfbp", replan="auto")
    state, plain = sched.init(_copy(params), _copy(opt_state)), (_copy(params), _copy(opt_state))
    for k, b in enumerate(batches):
        if k == 3:
            sched.replan("1gbe")
        state, _ = sched(state, b)
        *plain, _ = step(*plain, b)
    _assert_like_plain(sched.finalize(state), tuple(plain))


# -- ahead of time, for clusters we do not have ----------------------------------------------
def _abstract_fsdp(target: str, hsdp: bool):
    """An FSDP (or HSDP) step of 4 dense layers on compile-only devices, every input abstract."""
    import jaxsched.tools.aot as aot
    from jax.sharding import Mesh

    platform, topology = target.split(":")
    devices = np.array(aot.devices(platform, topology))
    mesh = Mesh(devices.reshape(2, -1), ("data", "fsdp")) if hsdp else Mesh(devices, ("fsdp",))
    batch_spec = P(("data", "fsdp")) if hsdp else P("fsdp")
    width, layers = 256, 4
    tx = optax.adamw(1e-3)

    def sharded(a):
        spec = P("fsdp", None) if a.ndim == 2 else P()
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))

    params = {f"w{i}": sharded(jax.ShapeDtypeStruct((width, width), jnp.float32)) for i in range(layers)}
    opt_state = jax.tree.map(sharded, jax.eval_shape(tx.init, params))
    batch = jax.ShapeDtypeStruct((16 * devices.size, width), jnp.float32, sharding=NamedSharding(mesh, batch_spec))

    @jax.jit
    def step(params, opt_state, x):
        def loss(p):
            h = x
            for i in range(layers):
                h = jnp.tanh(h @ p[f"w{i}"])
            return jnp.mean(h**2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": value}

    return step, params, opt_state, batch


@needs_gpu
@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_an_fsdp_step_lowers_and_inspects_for_a_gpu_cluster(strategy):
    step, params, opt_state, batch = _abstract_fsdp("h100:1x2x4", hsdp=False)
    sched = jaxsched.schedule(step, strategy=strategy)
    state = sched.init(params, opt_state)
    assert "reduce_scatter" in sched.lower(state, batch).as_text()
    inspection = sched.inspect(state, batch)
    kinds = {w.kind for w in inspection.report.collectives}
    assert {"all-gather", "reduce-scatter"} <= kinds, kinds
    assert inspection.report.step_s is not None and inspection.baseline.step_s is not None


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_block_gradients_scattered_in_two_stages_equal_the_plain_step(strategy, monkeypatch):
    """The stages a TPU torus gets (an exchange of halves over pairs, then a reduce-scatter
    over fours) hand each device the block one reduce-scatter would: forced on 8 CPU
    devices, every leaf equals the plain step's."""
    import jaxsched.strategies._base as strategy_base

    stages = (((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 1, 2, 3), (4, 5, 6, 7)))
    monkeypatch.setattr(strategy_base, "scatter_stages", lambda mesh, axes: stages)
    monkeypatch.setattr(strategy_base, "block_scatter_stages", lambda mesh, axes, nbytes: stages)
    tx = optax.adamw(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case("fsdp", tx, 29)
    sched, state, _ = _run(ss.mlp_step(tx, layout, mesh), params, opt_state, batches, strategy)
    text = sched.lower(state, batches[0]).as_text()
    # w1 and w2: each an exchange over pairs, then a reduce-scatter over fours
    assert text.count("collective_permute") >= 2 and text.count("reduce_scatter") >= 2


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_a_scanned_stack_scattered_in_two_stages_equals_the_plain_step(strategy, monkeypatch):
    """The per-layer reduce-scatters of a scanned, rematerialised FSDP stack (the partition
    stage's, inside the loop) in the stages a TPU torus gets, forced on 8 CPU devices: each
    device ends with the same block, every leaf equals the plain step's."""
    import jaxsched.core.partition._kinds as kinds
    from jaxsched.core._replay import nested_eqns

    stages = (((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 1, 2, 3), (4, 5, 6, 7)))
    monkeypatch.setattr(kinds, "block_scatter_stages", lambda mesh, axes, nbytes: stages if mesh is not None else ())
    mesh = ss.LAYOUTS["fsdp"].mesh()
    tx = optax.adamw(1e-2)
    params = ss.scanned_params(mesh, seed=41)
    batches = ss.batches(mesh, P("fsdp"), 3, 42)
    opt_state = tx.init(params)
    sched, _, _ = _run(ss.scanned_step(tx), params, opt_state, batches, strategy)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves((params, opt_state, batches[0]))]
    loops = [e for e in nested_eqns(sched.program.per_device.jaxpr(*args)) if e.primitive.name == "scan"]
    inside = [e.primitive.name for loop in loops for e in nested_eqns(loop.params["jaxpr"].jaxpr)]
    staged = [
        e
        for loop in loops
        for e in nested_eqns(loop.params["jaxpr"].jaxpr)
        if e.primitive.name == "reduce_scatter" and e.params.get("axis_index_groups")
    ]
    # the layer's weight gradient: an exchange over pairs, then a reduce-scatter over fours
    assert staged and "ppermute" in inside, inside


@needs_tpu
@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_fsdp_gradients_stay_reduce_scatters_on_a_3d_tpu_slice(strategy):
    """Over all 8 chips of a v5p 2x2x2 slice XLA:TPU decomposes one reduce-scatter into an
    all-reduce of the whole gradient; each block's gradient goes in two stages (an exchange
    of halves over a line, then a reduce-scatter over a plane of chips), which it keeps."""
    import re

    step, params, opt_state, batch = _abstract_fsdp("v5p:2x2x2", hsdp=False)
    sched = jaxsched.schedule(step, strategy=strategy)
    text = sched.lower(sched.init(params, opt_state), batch).compile().as_text()
    found = []
    for match in re.finditer(r"= (\(.*?\)|\S+) (all-reduce|reduce-scatter)(?:-start)?\(", text):
        for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", match.group(1)):
            found.append((match.group(2), int(np.prod([int(d) for d in dims.split(",") if d]))))
    whole = 256 * 256  # a layer's weight
    assert not [n for kind, n in found if kind == "all-reduce" and n >= whole // 8], found
    assert len([n for kind, n in found if kind == "reduce-scatter" and n == whole // 8]) >= 4, found
    assert re.search(r"collective-permute(-start)?\(", text)  # the stage over pairs of chips


@needs_tpu
@pytest.mark.parametrize("strategy", ["wfbp", pytest.param("dear", marks=pytest.mark.slow)])
def test_a_scanned_fsdp_stack_keeps_its_reduce_scatters_on_a_3d_tpu_slice(strategy):
    """A scanned, rematerialised stack's per-layer weight gradients are reduce-scattered inside
    the loop (by the partition stage, not a strategy): over all 8 chips of a v5p 2x2x2 slice
    they go in two stages too, which XLA:TPU keeps, not as an all-reduce of the whole
    gradient of a layer."""
    import re

    import jaxsched.tools.aot as aot
    from jax.sharding import Mesh

    mesh = Mesh(np.array(aot.devices("v5p", "2x2x2")), ("fsdp",))
    width, layers = 256, 4
    specs = {(layers, width, width): P(None, "fsdp", None), (layers, width): P(None, "fsdp"), (width, 128): P("fsdp")}

    def abstract(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, specs.get(a.shape, P())))

    shapes = {"ws": (layers, width, width), "bs": (layers, width), "head": (width, 128)}
    params = {k: abstract(jax.ShapeDtypeStruct(v, jnp.float32)) for k, v in shapes.items()}
    tx = optax.adamw(1e-3)
    opt_state = jax.tree.map(abstract, jax.eval_shape(tx.init, params))
    x = jax.ShapeDtypeStruct((16 * 8, width), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    y = jax.ShapeDtypeStruct((16 * 8, 128), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    sched = jaxsched.schedule(ss.scanned_step(tx), strategy=strategy)
    text = sched.lower(sched.init(params, opt_state), (x, y)).compile().as_text()
    found = []
    for match in re.finditer(r"= (\(.*?\)|\S+) (all-reduce|reduce-scatter)(?:-start)?\(", text):
        for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", match.group(1)):
            found.append((match.group(2), int(np.prod([int(d) for d in dims.split(",") if d]))))
    whole = width * width  # a layer's weight
    assert not [n for kind, n in found if kind == "all-reduce" and n >= whole // 8], found
    assert [n for kind, n in found if kind == "reduce-scatter" and n == whole // 8], found


def _v5p_mesh():
    import jaxsched.tools.aot as aot
    from jax.sharding import Mesh

    return Mesh(np.array(aot.devices("v5p", "2x2x2")), ("fsdp",))


@needs_tpu
def test_the_plain_fsdp_step_on_one_tpu_slice_is_estimated_with_its_all_to_alls():
    """XLA's partitioner gives the plain step all-to-alls, which XLA:TPU runs synchronously
    (no window for the instruction-cost estimate to read): priced as the all-gather that
    moves the same bytes, so the report still has an estimate and the ratios exist."""
    mesh = _v5p_mesh()
    ab = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
    params = {"w0": ab((256, 256), P("fsdp", None)), "b0": ab((256,), P()), "w1": ab((256, 256), P("fsdp", None))}
    tx = optax.sgd(0.1)
    batch = (ab((128, 256), P("fsdp")), ab((128, 256), P("fsdp")))

    step = _biased_mlp_step(tx)

    sched = jaxsched.schedule(step, strategy="wfbp")
    inspection = sched.inspect(sched.init(params, jax.eval_shape(tx.init, params)), batch)
    assert "all-to-all" in {w.kind for w in inspection.baseline.collectives}
    assert inspection.baseline.step_s is not None and inspection.ratios()["step"] is not None


@needs_tpu
def test_a_scanned_stack_reports_its_loops_on_a_tpu_slice():
    """XLA:TPU's loops carry no ``known_trip_count``: the trips are read from the scan's
    counter and bound, so the report has each loop (forward's, backward's) and its time;
    its gathers, fused after scheduling, are followed in the module as it was scheduled."""
    mesh, layers = _v5p_mesh(), 3
    ab = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
    params = {"ws": ab((layers, 256, 256), P(None, "fsdp", None)), "head": ab((256, 128), P("fsdp", None))}
    tx = optax.sgd(0.1)
    batch = (ab((128, 256), P("fsdp")), ab((128, 128), P("fsdp")))

    @jax.jit
    def step(params, opt_state, batch):
        x, y = batch

        def loss_fn(p):
            h, _ = jax.lax.scan(jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None)), x, p["ws"])
            return jnp.mean((h @ p["head"] - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    sched = jaxsched.schedule(step, strategy="wfbp")
    inspection = sched.inspect(sched.init(params, jax.eval_shape(tx.init, params)), batch)
    report = inspection.report
    # the plain step, which XLA:TPU schedules without its options: estimated from the
    # instruction costs, its loops' synchronous gathers and scatters counted every iteration
    assert inspection.baseline.step_s is not None and inspection.ratios()["step"] is not None
    assert [loop.trips for loop in report.loops] == [layers, layers]
    assert all(loop.seconds > 0 for loop in report.loops)
    # a whole layer gathered at a time (XLA:TPU feeds its matmuls bf16 copies: 2 bytes each)
    assert all(loop.peak_gathered_bytes >= 256 * 256 * 2 for loop in report.loops)


@needs_tpu
@pytest.mark.slow
def test_an_hsdp_step_inspects_for_a_tpu_pod():
    step, params, opt_state, batch = _abstract_fsdp("v5p:2x2x2", hsdp=True)
    sched = jaxsched.schedule(step, strategy="wfbp")
    inspection = sched.inspect(sched.init(params, opt_state), batch)
    kinds = {w.kind for w in inspection.report.collectives}
    assert {"all-gather", "reduce-scatter"} <= kinds, kinds


def test_a_state_step_refusal_names_the_leaf_by_its_place_in_the_state():
    """A TrainState's optimizer moment is named as the state holds it, not as a parameter."""
    from flax.training.train_state import TrainState

    layout = ss.LAYOUTS["hsdp"]
    mesh = layout.mesh()
    tx = optax.adam(1e-2)
    params = ss.place(mesh, ss.params_for(0), {"w1": P(), "b1": P(), "w2": P()})
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    mu = state.opt_state[0].mu
    bad = jax.device_put(mu["w1"], NamedSharding(mesh, P("data", "fsdp")))
    state = state.replace(opt_state=(state.opt_state[0]._replace(mu={**mu, "w1": bad}), *state.opt_state[1:]))

    @jax.jit
    def step(state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2))(
            state.params
        )
        return state.apply_gradients(grads=grads), {"loss": loss}

    sched = jaxsched.schedule(step, strategy="wfbp")
    with pytest.raises(
        jaxsched.UnsupportedStepError, match=r"^state/opt_state/0/mu/w1 is sharded with P\('data', 'fsdp'\)"
    ):
        sched(sched.init(state), ss.batches(mesh, layout.batch, 1, 0)[0])


@pytest.mark.parametrize("strategy", ["dear", pytest.param("wfbp", marks=pytest.mark.slow)])
def test_a_train_state_step_with_fsdp_parameters(strategy):
    from flax.training.train_state import TrainState

    layout = ss.LAYOUTS["fsdp"]
    mesh = layout.mesh()
    tx = optax.adamw(1e-2)
    params = ss.place(mesh, ss.params_for(37), layout.params)
    state = TrainState.create(apply_fn=None, params=params, tx=tx)

    @jax.jit
    def step(state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2))(
            state.params
        )
        return state.apply_gradients(grads=grads), {"loss": loss}

    batches = ss.batches(mesh, layout.batch, 3, 38)
    plain = _copy(state)
    for b in batches:
        plain, _ = step(plain, b)
    sched = jaxsched.schedule(step, strategy=strategy)
    sstate = sched.init(_copy(state))
    for b in batches:
        sstate, _ = sched(sstate, b)
    got = sched.finalize(sstate)
    assert type(got) is TrainState and int(got.step) == 3
    _assert_like_plain(got.params, plain.params)
    _assert_like_plain(got.opt_state, plain.opt_state)
    assert sorted(sched.program.planned.paths) == ["params/b1", "params/w1", "params/w2"]


def test_dear_shards_the_hsdp_update_over_the_replica_axis():
    """On HSDP dear reduce-scatters each block over "data" and keeps the parameters and the
    moments as chunks of the blocks over it: less state per device than the plain step."""
    tx = optax.adamw(1e-2)
    layout, mesh, params, opt_state, batches = _mlp_case("hsdp", tx, 41)
    sched, state, plain = _run(ss.mlp_step(tx, layout, mesh), params, opt_state, batches, "dear")
    w1 = state.params["w1"]
    assert w1.ndim == 1 and w1.sharding.spec == P(("fsdp", "data"))  # each fsdp block, chunked over data
    mu_w1 = state.opt_state[0].mu["w1"]
    assert mu_w1.sharding.spec == P(("fsdp", "data"))
    assert ss.state_bytes((state.params, state.opt_state)) < 0.6 * ss.state_bytes(plain)


@pytest.mark.parametrize("strategy", ["wfbp", "dear"])
def test_hsdp_replica_sum_goes_through_the_hierarchy_and_compression(strategy):
    """The sum over the replica axis is the bucket collective's: a Hierarchical(fast, slow)
    sums an HSDP block over the slow axis alone (exact); a cast to bfloat16 sends the blocks
    over "data" in bfloat16 and nothing else."""
    from jaxsched.runtime.collectives import Hierarchical
    from jaxsched.runtime.compress import Cast

    tx = optax.sgd(0.1)
    layout, mesh, params, opt_state, batches = _mlp_case("hsdp", tx, 43)
    step = ss.mlp_step(tx, layout, mesh)
    _run(step, params, opt_state, batches, strategy, collective=Hierarchical("fsdp", "data"))
    sched = jaxsched.schedule(step, strategy=strategy, compression=Cast("bfloat16"))
    state = sched.init(params, opt_state)
    state, _ = sched(state, batches[0])
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves((state, batches[0]))]
    jaxpr = sched.program.per_device.jaxpr(*abstract)
    over_data = [
        e.invars[0].aval.dtype
        for e in jaxpr.eqns
        if e.primitive.name in ("psum", "reduce_scatter")
        and tuple(e.params.get("axes", e.params.get("axis_name"))) == ("data",)
    ]
    assert over_data and all(d == jnp.bfloat16 for d in over_data)
