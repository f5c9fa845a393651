"""``approx``: the optax wrappers against hand-written recurrences, the strategy against an
independent data-parallel reference, its program's independence of the collective, and
what it refuses."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P

import jaxsched
from jaxsched.demo import steps
from jaxsched.strategies._approx import SMALL_GRADIENT_ELEMENTS, PendingLayout
from jaxsched.strategies._approximation import ApproxParams, approximate, staleness_aware
from support.equivalence import assert_trees_close, build, random_batches, run_both

# Every test here compiles scheduled steps: they run in `make test-slow` (CI runs both),
# which keeps `make test` under 5 minutes on 2 cores.
pytestmark = pytest.mark.slow

METHODS = ("stale", "local", "extrapolate")

# ----------------------------------------------------------------------------- wrappers
A = np.diag(np.array([3.0, 1.0, 0.5], np.float32))
B = np.array([1.0, -2.0, 0.5], np.float32)
THETA0 = np.array([2.0, 1.0, -1.0], np.float32)
LR, MOMENTUM = 0.1, 0.9


def quadratic_grad(theta):
    return A @ theta - B


def momentum_step(theta, velocity, grad, lr=LR):
    """optax.sgd(lr, momentum) written out: v <- g + m v; θ <- θ - lr v."""
    velocity = grad + MOMENTUM * velocity
    return theta - lr * velocity, velocity


def reference_trajectory(method, k, n_steps, lr=LR):
    """The recurrences of the issue, by hand: per step (θ̃_t, θ after step t)."""
    thetas, velocities, grads, out = [THETA0], [np.zeros(3, np.float32)], [], []
    for t in range(n_steps):
        m = max(t - k, 0)  # gradients applied before step t; θ_m is all a worker knows
        if method == "stale" or k == 0:
            point = thetas[m]
        elif method == "extrapolate":
            point = thetas[m] + k * (thetas[m] - thetas[max(m - 1, 0)])
        else:  # local: U on the pending gradients g_m .. g_{t-1}, from (θ_m, v_m)
            point, v = thetas[m], velocities[m]
            for g in grads[m:t]:
                point, v = momentum_step(point, v, g, lr)
        grads.append(quadratic_grad(point))
        if t >= k:  # g_{t-k} arrives at the end of step t
            theta, v = momentum_step(thetas[t - k], velocities[t - k], grads[t - k], lr)
            thetas.append(theta)
            velocities.append(v)
        out.append((point, thetas[-1]))
    return out


def wrapper_trajectory(tx, n_steps, jit):
    params = ApproxParams.init_synced(jnp.asarray(THETA0))
    state = tx.init(params)

    def step(params, state):
        grads = jnp.asarray(A) @ params.approx - jnp.asarray(B)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step) if jit else step
    out = []
    for _ in range(n_steps):
        point = params.approx
        params, state = step(params, state)
        out.append((np.asarray(point), np.asarray(params.true)))
    return out


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("method", METHODS)
def test_the_wrapper_follows_the_hand_written_recurrence(method, k, jit):
    tx = approximate(optax.sgd(LR, momentum=MOMENTUM), method=method, staleness=k)
    got = wrapper_trajectory(tx, 12, jit)
    want = reference_trajectory(method, k, 12)
    for t, ((point, true), (ref_point, ref_true)) in enumerate(zip(got, want)):
        np.testing.assert_allclose(true, ref_true, rtol=1e-5, atol=1e-6, err_msg=f"θ after step {t}")
        np.testing.assert_allclose(point, ref_point, rtol=1e-5, atol=1e-6, err_msg=f"θ̃ of step {t}")
    # the methods really differ, and the delay really changes the trajectory
    assert not np.allclose(got[-1][1], reference_trajectory("stale", 0, 12)[-1][1], rtol=1e-3)
    # no conditional in the update: XLA:GPU would read its predicate on the host every step
    params = ApproxParams.init_synced(jnp.ones(3))
    update = jax.make_jaxpr(tx.update)(jnp.ones(3), tx.init(params.true), params)
    assert not [e for e in update.eqns if e.primitive.name == "cond"]


@pytest.mark.parametrize("method", METHODS)
def test_staleness_zero_is_the_inner_optimizer_exactly(method):
    inner = optax.adamw(0.05, weight_decay=0.1)
    tx = approximate(inner, method=method, staleness=0)
    params = ApproxParams.init_synced(jnp.asarray(THETA0))
    plain, inner_state, state = jnp.asarray(THETA0), inner.init(jnp.asarray(THETA0)), tx.init(params)
    for _ in range(10):
        updates, state = jax.jit(tx.update)(A @ params.approx - B, state, params)
        params = optax.apply_updates(params, updates)
        plain_updates, inner_state = jax.jit(inner.update)(A @ plain - B, inner_state, plain)
        plain = optax.apply_updates(plain, plain_updates)
        np.testing.assert_array_equal(np.asarray(params.true), np.asarray(plain))
        np.testing.assert_array_equal(np.asarray(params.approx), np.asarray(plain))
    assert_trees_close(state.inner_state, inner_state, rtol=0, atol=0)


def test_staleness_aware_scales_the_step_by_one_over_tau():
    # approximate passes its staleness to the rule: 1/k of the step at k = 2
    scaled = approximate(staleness_aware(optax.sgd(LR, momentum=MOMENTUM)), "stale", staleness=2)
    slow = approximate(optax.sgd(LR / 2, momentum=MOMENTUM), "stale", staleness=2)
    for (p1, t1), (p2, t2) in zip(wrapper_trajectory(scaled, 8, True), wrapper_trajectory(slow, 8, True)):
        np.testing.assert_allclose(t1, t2, rtol=1e-6)
        np.testing.assert_allclose(p1, p2, rtol=1e-6)
    # fresh and one-step-old gradients keep the full step; a constructed tau is used alone
    for tau, scale in ((0, 1.0), (1, 1.0), (4, 0.25)):
        tx = staleness_aware(optax.sgd(1.0), staleness=tau)
        updates, _ = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))
        np.testing.assert_allclose(updates, -scale * np.ones(2))
    tx = staleness_aware(optax.sgd(1.0), rule=lambda tau: 0.5**tau)
    updates, _ = jax.jit(tx.update, static_argnames=())(jnp.ones(2), tx.init(jnp.zeros(2)), staleness=2)
    np.testing.assert_allclose(updates, -0.25 * np.ones(2))


def test_the_wrappers_refuse_bad_inputs_at_construction():
    with pytest.raises(ValueError, match="method 'newest' is unknown.*'stale', 'local', 'extrapolate'"):
        approximate(optax.sgd(0.1), method="newest")
    with pytest.raises(ValueError, match="staleness=-1 is negative"):
        approximate(optax.sgd(0.1), staleness=-1)
    with pytest.raises(TypeError, match="staleness must be an int"):
        approximate(optax.sgd(0.1), staleness=1.5)
    with pytest.raises(TypeError, match="did you pass optax.sgd instead of optax.sgd\\(learning_rate\\)"):
        approximate(optax.sgd)
    with pytest.raises(TypeError, match="needs an optax.GradientTransformation.*got dict"):
        staleness_aware({"lr": 0.1})
    with pytest.raises(ValueError, match="staleness rule 'linear' is unknown"):
        staleness_aware(optax.sgd(0.1), rule="linear")
    tx = staleness_aware(optax.sgd(0.1))
    with pytest.raises(ValueError, match="does not know the staleness"):
        tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))
    tx = approximate(optax.sgd(0.1))
    with pytest.raises(TypeError, match="params=ApproxParams"):
        tx.update(jnp.ones(2), tx.init(jnp.zeros(2)), jnp.zeros(2))


# ----------------------------------------------------------------------------- strategy
def data_parallel_reference(apply_fn, tx, params, batches, method, k, devices):
    """The recurrence with per-device gradients, written with vmap over devices (no
    shard_map, no jaxsched): returns the true params and opt_state after every gradient
    has been applied, and the true params after each step."""

    def local_grad(p, x, y):
        return jax.grad(lambda q: steps.cross_entropy(apply_fn(q, x), y))(p)

    def update(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    per_device = jax.jit(jax.vmap(local_grad))
    mean = lambda g: jax.tree.map(lambda a: a.mean(0), g)
    stack = lambda tree: jax.tree.map(lambda a: jnp.broadcast_to(a, (devices,) + a.shape), tree)
    thetas, opts, local, after = [params], [tx.init(params)], [], []
    for t, (x, y) in enumerate(batches):
        m = max(t - k, 0)
        if method == "stale" or k == 0:
            point = stack(thetas[m])
        elif method == "extrapolate":
            point = stack(jax.tree.map(lambda a, b: a + k * (a - b), thetas[m], thetas[max(m - 1, 0)]))
        else:  # each device: U on its own pending gradients, from the true state
            point, s = stack(thetas[m]), stack(opts[m])
            for g in local[m:t]:
                point, s = jax.vmap(update)(point, s, g)
        xs = x.reshape(devices, -1, *x.shape[1:])
        ys = y.reshape(devices, -1)
        local.append(per_device(point, xs, ys))
        if t >= k:
            p, s = update(thetas[t - k], opts[t - k], mean(local[t - k]))
            thetas.append(p)
            opts.append(s)
        after.append(thetas[-1])
    p, s = thetas[-1], opts[-1]
    for g in local[len(thetas) - 1 :]:  # what finalize drains
        p, s = update(p, s, mean(g))
    return (p, s), after


@pytest.mark.parametrize(
    "method, k", [("stale", 1), ("local", 1), ("extrapolate", 1), ("local", 2), ("extrapolate", 3)]
)
def test_the_strategy_runs_the_recurrence_and_finalize_drains_it(method, k):
    devices, n_steps = 8, 6
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.05, momentum=0.9)
    mesh = jax.make_mesh((devices,), ("data",))
    batches = list(random_batches("mlp", n_steps, 2 * devices, seed=4))
    sched = jaxsched.schedule(
        steps.make_step(apply_fn, tx, mesh), strategy="approx", approx_method=method, staleness=k, buckets=2000
    )
    state = sched.init(params, tx.init(params))
    final, after = data_parallel_reference(apply_fn, tx, params, batches, method, k, devices)
    for t, batch in enumerate(batches):
        state, aux = sched(state, steps.shard_batch(batch, mesh))
        jax.block_until_ready(state)
        assert_trees_close(state.params, after[t])  # θ_{t-k+1}: exactly the arrived gradients
    assert int(state.num_pending) == k and len(sched.program.buckets) > 1
    assert_trees_close(sched.finalize(state), final)
    # finalize leaves the state alone: training can go on
    assert int(state.num_pending) == k


def test_the_pending_layout_keeps_large_gradients_whole_and_packs_small_ones_per_dtype():
    shapes = [
        ((300, 300), jnp.float32),
        ((3,), jnp.bfloat16),
        ((), jnp.float32),
        ((4, 5), jnp.float32),
        ((400, 200), jnp.bfloat16),
        ((7,), jnp.bfloat16),
        ((0,), jnp.float32),
    ]
    layout = PendingLayout.of([jax.ShapeDtypeStruct(s, d) for s, d in shapes])
    assert [(a.shape, str(a.dtype)) for a in layout.arrays] == [
        ((300, 300), "float32"),
        ((400, 200), "bfloat16"),
        ((10,), "bfloat16"),
        ((21,), "float32"),
    ]
    rng = np.random.default_rng(0)
    grads = [jnp.asarray(rng.standard_normal(s), d) for s, d in shapes]
    arrays = layout.pack(grads)
    assert [(a.shape, str(a.dtype)) for a in arrays] == [(a.shape, str(a.dtype)) for a in layout.arrays]
    assert arrays[0] is grads[0] and arrays[1] is grads[4]  # no copy of a large gradient
    for got, want in zip(layout.unpack(arrays), grads, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_pending_gradients_travel_packed_one_array_per_dtype_and_unpack_in_place():
    # biases in bfloat16: two dtypes, so a slot holds two packed arrays; a gradient
    # unpacked into another's place would be far off the reference
    devices, k, n_steps = 8, 2, 5
    params, apply_fn = build("mlp", 0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: a.astype(jnp.bfloat16) if "bias" in jax.tree_util.keystr(path) else a, params
    )
    tx = optax.sgd(0.05, momentum=0.9)
    mesh = jax.make_mesh((devices,), ("data",))
    batches = list(random_batches("mlp", n_steps, 2 * devices, seed=5))
    step = steps.make_step(apply_fn, tx, mesh)
    sched = jaxsched.schedule(step, strategy="approx", approx_method="local", staleness=k)
    state = sched.init(params, tx.init(params))
    final, after = data_parallel_reference(apply_fn, tx, params, batches, "local", k, devices)
    for t, batch in enumerate(batches):
        state, _ = sched(state, steps.shard_batch(batch, mesh))
        assert_trees_close(state.params, after[t], rtol=2e-2, atol=1e-2)
    small = [leaf for leaf in jax.tree.leaves(params) if leaf.size <= SMALL_GRADIENT_ELEMENTS]
    assert len(small) == len(jax.tree.leaves(params))  # this model's gradients are all small
    sizes = {}
    for leaf in small:
        sizes[leaf.dtype] = sizes.get(leaf.dtype, 0) + leaf.size
    assert len(state.pending) == k
    for slot in state.pending:
        assert sorted((str(a.dtype), a.shape) for a in slot) == sorted((str(d), (devices, n)) for d, n in sizes.items())
    assert_trees_close(sched.finalize(state), final, rtol=2e-2, atol=1e-2)
    # a state whose pending arrays do not fit this step is refused, not misread
    wrong = state._replace(pending=tuple(tuple(a[:, 1:] for a in slot) for slot in state.pending))
    with pytest.raises(ValueError, match="pending gradients do not fit this step"):
        sched(wrong, steps.shard_batch(batches[0], mesh))


@pytest.mark.parametrize("devices, gate, conditional", [(1, None, False), (8, None, True), (8, "fenced", False)])
def test_the_warm_up_gate_is_a_select_only_where_nothing_is_reduced(devices, gate, conditional, monkeypatch):
    """One device: θ̃'s warm-up gate is a select (a GPU sends a conditional's predicate to
    the host on every step). With a reduction it stays a conditional, the fusion boundary
    that keeps forward and backward from waiting for it, except on a GPU, where the gate is
    a select behind an optimization barrier (forced here on CPU). All run the recurrence."""
    if gate == "fenced":
        from jaxsched.strategies import _approx, _approximation

        monkeypatch.setattr(_approx.Approx, "_warm_up_gate", staticmethod(lambda planned: _approximation.fenced))
    n_steps, k = 5, 2
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.05, momentum=0.9)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    batches = list(random_batches("mlp", n_steps, 2 * devices, seed=5))
    sched = jaxsched.schedule(
        steps.make_step(apply_fn, tx, mesh), strategy="approx", approx_method="local", staleness=k
    )
    state = sched.init(params, tx.init(params))
    _, after = data_parallel_reference(apply_fn, tx, params, batches, "local", k, devices)
    for t, batch in enumerate(batches):
        state, _ = sched(state, steps.shard_batch(batch, mesh))
        assert_trees_close(state.params, after[t])
    jaxpr = _per_device_jaxpr(sched, state, steps.shard_batch(batches[0], mesh))
    assert any(eqn.primitive.name == "cond" for eqn in jaxpr.eqns) == conditional
    barriers = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "optimization_barrier"]
    assert bool(barriers) == (gate == "fenced")


@pytest.mark.parametrize("api", ["shard_map", "pmap"])
def test_staleness_zero_equals_allreduce(api):
    tx = optax.adam(1e-2)
    plain, scheduled, plain_aux, sched_aux, sched = run_both(
        "mlp", tx, "approx", 8, n_steps=8, api=api, staleness=0, buckets=1000
    )
    assert_trees_close(scheduled, plain, rtol=1e-5)
    assert_trees_close(sched_aux, plain_aux, rtol=1e-5)
    assert len(sched.program.buckets) > 1


def _per_device_jaxpr(sched, state, batch):
    program = sched.program
    return program.per_device.jaxpr(*program.inputs(state, batch))


@pytest.mark.parametrize("method", METHODS)
def test_forward_and_backward_never_read_the_collective(method):
    params, apply_fn = build("cnn", 0)
    tx = optax.adam(1e-3)
    mesh = jax.make_mesh((8,), ("data",))
    batch = steps.shard_batch(next(random_batches("cnn", 1, 16, 0)), mesh)
    sched = jaxsched.schedule(
        steps.make_step(apply_fn, tx, mesh), strategy="approx", approx_method=method, staleness=1, buckets=300
    )
    state, _ = sched(sched.init(params, tx.init(params)), batch)
    jaxpr = _per_device_jaxpr(sched, state, batch)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    pending_in = {jaxpr.invars[i] for i, p in enumerate(paths) if ".pending" in p}
    pending_out = [jaxpr.outvars[i] for i, p in enumerate(paths) if ".pending" in p]
    n_state = len(paths)

    # the gradient reductions: the psums of values made from the pending gradients alone
    # (with `local`, forward reads the pending gradients too, through θ̃, but also the batch)
    batch_in = set(jaxpr.invars[n_state:])
    from_pending, from_batch, reductions = set(pending_in), set(batch_in), []
    for eqn in jaxpr.eqns:
        operands = [x for x in eqn.invars if not isinstance(x, jex_core.Literal)]
        if any(x in from_batch for x in operands):
            from_batch.update(eqn.outvars)
        elif any(x in from_pending for x in operands):
            if eqn.primitive.name == "psum":
                reductions.append(eqn)
            else:
                from_pending.update(eqn.outvars)
    # per bucket, one psum per large pending gradient and one for its small ones together
    assert len(sched.program.buckets) > 1
    assert len(sched.program.buckets) <= len(reductions) <= sum(len(b.reductions) for b in sched.program.buckets)
    # each is issued before any forward work: only slicing/packing of its operands precedes it
    first_compute = next(
        i for i, e in enumerate(jaxpr.eqns) if e.primitive.name in ("dot_general", "conv_general_dilated")
    )
    assert all(jaxpr.eqns.index(r) < first_compute for r in reductions)

    # nothing of forward or backward is downstream of them
    tainted = {o for r in reductions for o in r.outvars}
    downstream = []
    for eqn in jaxpr.eqns:
        if any(x in tainted for x in eqn.invars if not isinstance(x, jex_core.Literal)):
            tainted.update(eqn.outvars)
            downstream.append(eqn.primitive.name)
    assert not any(v in tainted for v in pending_out)  # the new local gradients
    assert not {"conv_general_dilated", "dot_general"} & set(downstream)
    loss_out = jaxpr.outvars[n_state:]  # aux: loss and accuracy of this step's forward
    assert loss_out and not any(v in tainted for v in loss_out)
    assert all(v in tainted for v in jaxpr.outvars[: len(jax.tree.leaves(state.params))])  # the update does
    # and the lowered program has exactly these all-reduces plus the two metric pmeans
    text = sched.lower(state, batch).as_text()
    assert text.count("all_reduce") >= len(reductions)


@pytest.mark.parametrize("k", [1, 2])
def test_a_metric_of_the_reduced_gradients_reads_zero_until_the_first_one_arrives(k):
    """As documented: aux derived from the reduced gradients belongs to step t-k, and the
    first k steps compute it on zeros."""
    params, apply_fn = build("mlp", 0)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    tx = optax.sgd(0.1)

    def body(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: steps.cross_entropy(apply_fn(p, x), y))(params)
        grads = lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"gnorm": optax.global_norm(grads)}

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())))
    sched = jaxsched.schedule(step, strategy="approx", approx_method="stale", staleness=k)
    state = sched.init(params, tx.init(params))
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", k + 1, 8, 3)]
    norms = []
    for batch in batches:
        state, aux = sched(state, batch)
        norms.append(float(aux["gnorm"]))
    _, _, first = step(params, tx.init(params), batches[0])  # step 0's gradient, at θ_0
    assert norms[:k] == [0.0] * k
    np.testing.assert_allclose(norms[k], float(first["gnorm"]), rtol=1e-5)


def _step_with(update_from_loss=False, second_pmean=False, tx=optax.sgd(0.1)):
    params, apply_fn = build("mlp", 0)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])

    def body(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(lambda p: steps.cross_entropy(apply_fn(p, x), y))(params)
        grads = lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        if update_from_loss:  # a loss-dependent step size: reads forward
            updates = jax.tree.map(lambda u: u * jnp.minimum(1.0, loss), updates)
        if second_pmean:  # the update communicates
            updates = lax.pmean(updates, "data")
        return optax.apply_updates(params, updates), opt_state, {"loss": lax.pmean(loss, "data")}

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )
    batch = steps.shard_batch(next(random_batches("mlp", 1, 8, 0)), mesh)
    return step, params, tx.init(params), batch


def test_an_update_that_reads_forward_is_refused_naming_the_equation():
    step, params, opt_state, batch = _step_with(update_from_loss=True)
    sched = jaxsched.schedule(step, strategy="approx", approx_method="stale")
    with pytest.raises(
        jaxsched.UnsupportedStepError,
        match=r"approx cannot delay.*feeds the new params/opt_state and reads the "
        r"result of .* at .*\(forward/backward\).*staleness=0",
    ):
        sched(sched.init(params, opt_state), batch)
    # synchronous approx runs it
    sync = jaxsched.schedule(step, strategy="approx", staleness=0)
    sync(sync.init(params, opt_state), batch)


def test_local_refuses_an_update_that_communicates_and_stale_runs_it():
    step, params, opt_state, batch = _step_with(second_pmean=True)
    local = jaxsched.schedule(step, strategy="approx", approx_method="local")
    with pytest.raises(jaxsched.UnsupportedStepError, match=r"'local'.*communicates \(psum at .*test_approx.py"):
        local(local.init(params, opt_state), batch)
    stale = jaxsched.schedule(step, strategy="approx", approx_method="stale")
    state, aux = stale(stale.init(params, opt_state), batch)
    assert np.isfinite(float(aux["loss"]))


def test_the_strategy_refuses_bad_options():
    with pytest.raises(ValueError, match="method 'newest' is unknown"):
        jaxsched.schedule(lambda *a: a, strategy="approx", approx_method="newest")
    with pytest.raises(ValueError, match="staleness=-2 is negative"):
        jaxsched.schedule(lambda *a: a, strategy="approx", staleness=-2)
    with pytest.raises(TypeError, match="unknown options \\['stalenes'\\]"):
        jaxsched.schedule(lambda *a: a, strategy="approx", stalenes=2)


class CountingCollective(jaxsched.CollectiveWrapper):
    def init_own(self, bucket):
        return jnp.zeros((), jnp.int32)

    def all_reduce(self, buffer, axis_name, bucket, state):
        out, (own, inner) = super().all_reduce(buffer, axis_name, bucket, state)
        return out, (own + 1, inner)


def test_a_collective_wrapper_carries_through_and_changes_no_number():
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.1)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", 3, 8, 2)]
    results = []
    for collective in (None, CountingCollective()):
        sched = jaxsched.schedule(
            steps.make_step(apply_fn, tx, mesh), strategy="approx", collective=collective, buckets=1
        )
        state = sched.init(params, tx.init(params))
        for batch in batches:
            state, _ = sched(state, batch)
            jax.block_until_ready(state)
        results.append((sched.finalize(state), state))
    assert_trees_close(results[0][0], results[1][0])
    counts = jax.tree.leaves(results[1][1].collective_state)
    assert counts and all(np.all(np.asarray(c) == 3) for c in counts)  # one reduction per step


@pytest.mark.slow  # a heavy compile: runs in `make test-slow` (CI runs both)
def test_a_pmap_step_runs_the_same_recurrence_as_its_shard_map_twin():
    tx = optax.sgd(0.05, momentum=0.9)
    options = dict(n_steps=4, approx_method="local", staleness=2, buckets=1000)
    _, mapped, _, mapped_aux, _ = run_both("mlp", tx, "approx", 8, api="pmap", **options)
    _, sharded, _, sharded_aux, _ = run_both("mlp", tx, "approx", 8, api="shard_map", **options)
    assert_trees_close(jax.tree.map(lambda a: np.asarray(a)[0], mapped), sharded)
    assert_trees_close([a["loss"][0] for a in mapped_aux], [a["loss"] for a in sharded_aux])
