"""``dear`` on the optimizers and steps people use: the update on shards, one all-gather per
bucket, only the reductions an optimizer needs by its nature, optimizer state at 1/P, and
the plain step's numbers. A rule that cannot be exact falls back and says so."""

import functools
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxsched
from jaxsched.demo import steps
from support.equivalence import assert_trees_close, build, random_batches
from support.hlo_counts import collectives
import support.optimizer_zoo as zoo

# optimizers that stayed on shards before the rules for control flow, boolean and partial
# reductions: in the slow suite, to keep `make test` short
SLOW = {
    "adam",
    "nadamw",
    "lion",
    "lamb",
    "sgd_nesterov",
    "rmsprop",
    "masked",
    "schedule_free",
    "zero_nans",
    "clip_adam",
}
ON_SHARDS = [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in zoo.OPTIMIZERS if name != "muon"
]


@pytest.mark.parametrize("name", ON_SHARDS)
def test_optimizer_runs_its_update_on_shards(name):
    run = zoo.run(name, devices=8, n_steps=2)
    assert run["fallbacks"] == []
    assert all(r.on_shards for r in run["sched"].program.bucket_report)
    found = run["collectives"]
    # one all-gather and one reduce-scatter per bucket, each of the whole bucket
    assert len(found["all_gather"]) == len(found["reduce_scatter"]) == run["buckets"] == 1
    # all-reduces only of what the optimizer needs by its nature: scalars (a global norm's
    # per-leaf sums, batched into one vector; a finite check, the loss), adafactor's row and
    # column sums; nothing gradient-sized
    if name == "adafactor":
        assert sum(found["all_reduce"]) < run["param_elements"] // 4
    else:
        assert max(found["all_reduce"]) <= len(jax.tree.leaves(run["plain"])), found["all_reduce"]
    padding = 4 * run["devices"] * len(jax.tree.leaves(run["plain"][1]))
    if name != "adafactor":  # adafactor's factored statistics are small and stay whole
        assert run["opt_bytes_per_device"] <= run["opt_bytes_plain"] / run["devices"] + padding
    assert_trees_close(run["got"], run["plain"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_muon_falls_back_exactly_and_says_where():
    """Newton-Schulz orthogonalizes each whole matrix: by its nature not on shards."""
    run = zoo.run("muon", devices=8, n_steps=2)
    assert any("_muon.py" in m for m in run["fallbacks"])
    (report,) = run["sched"].program.bucket_report
    assert not report.on_shards and ("scan" in {p for p, _ in report.fallbacks})
    assert_trees_close(run["got"], run["plain"], rtol=1e-5, atol=1e-6)


def _mesh(n=8):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _check(local, params, opt_state, n_steps=2, check_vma=False, **options):
    """Plain and dear of a shard_map ``local(params, opt_state, batch)``; what dear did."""
    mesh = _mesh()
    step = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=check_vma)
    )
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", n_steps, 16, 1)]
    plain = (params, opt_state)
    for b in batches:
        plain = step(*plain, b)[:2]
    sched = jaxsched.schedule(step, strategy="dear", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsched.FallbackWarning)
        state = sched.init(params, opt_state)
        for b in batches:
            state, _ = sched(state, b)
        found = collectives(sched.lower(state, batches[0]).as_text())
    assert_trees_close(jax.device_get(sched.finalize(state)), jax.device_get(plain), rtol=1e-5, atol=1e-6)
    return sched, found


def test_a_psummed_global_count_that_divides_the_gradients_is_no_gradient_reduction():
    """AlgoPerf's ``grads / n_valid_examples``: the count is summed whole, one scalar."""
    params, apply_fn = build("mlp", 0)
    tx = optax.adamw(zoo.SCHEDULE)

    def local(p, s, batch):
        x, y = batch
        mask = (y >= 0).astype(jnp.float32)
        loss_fn = lambda q: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(apply_fn(q, x), y) * mask)
        loss, g = jax.value_and_grad(loss_fn)(p)
        n_valid = lax.psum(jnp.sum(mask), "data")
        g = jax.tree.map(lambda t: lax.psum(t, "data") / n_valid, g)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, lax.psum(loss, "data") / n_valid

    sched, found = _check(local, params, tx.init(params))
    assert len(found["all_gather"]) == len(found["reduce_scatter"]) == 1
    assert set(found["all_reduce"]) == {1}


def test_dead_forward_code_in_the_update_region_is_not_cut():
    """big_vision's unused ``logits_2d`` branch: XLA drops it; so must the update region."""
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.1, momentum=0.9)

    def local(p, s, batch):
        x, y = batch
        loss, g = jax.value_and_grad(
            lambda q: optax.softmax_cross_entropy_with_integer_labels(apply_fn(q, x), y).mean()
        )(p)
        u, s = tx.update(lax.pmean(g, "data"), s, p)
        new = optax.apply_updates(p, u)
        _unused = apply_fn(new, x)  # a forward nobody reads
        return new, s, lax.pmean(loss, "data")

    _, found = _check(local, params, tx.init(params))
    assert len(found["all_gather"]) == 1


def test_check_vma_step_stays_on_shards():
    """Under check_vma JAX reduces each gradient in backward, a bias as its (1, n) sum."""
    params, apply_fn = build("mlp", 0)
    tx = optax.adam(zoo.SCHEDULE)

    def local(p, s, batch):
        x, y = batch
        loss, g = jax.value_and_grad(
            lambda q: optax.softmax_cross_entropy_with_integer_labels(apply_fn(q, x), y).mean()
        )(p)
        g = jax.tree.map(lambda t: t / 8, g)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, lax.pmean(loss, "data")

    sched, found = _check(local, params, tx.init(params), check_vma=True)
    assert len(found["all_gather"]) == len(found["reduce_scatter"]) == len(sched.program.buckets) == 1


def test_dynamic_scale_is_not_trained_and_its_finite_check_is_one_scalar_reduction():
    """Flax ImageNet's loss scaling in a ``step(state, batch)``: the scale (and an EMA of the
    parameters) is state, not a parameter; the all-finite check of the gradients is one
    scalar collective."""
    params, apply_fn = build("mlp", 0)
    tx = optax.sgd(0.1, momentum=0.9)
    state = {"params": params, "opt": tx.init(params), "scale": DynamicScale(growth_interval=2), "ema": params}

    def body(state, batch):
        x, y = batch
        loss_fn = lambda q: optax.softmax_cross_entropy_with_integer_labels(apply_fn(q, x), y).mean()
        scale, is_fin, loss, g = state["scale"].value_and_grad(loss_fn, axis_name="data")(state["params"])
        u, opt = tx.update(g, state["opt"], state["params"])
        new = optax.apply_updates(state["params"], u)
        keep = functools.partial(jnp.where, is_fin)
        new = jax.tree.map(keep, new, state["params"])
        ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, state["ema"], new)
        return {"params": new, "opt": jax.tree.map(keep, opt, state["opt"]), "scale": scale, "ema": ema}, loss

    mesh = _mesh()
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False))
    batches = [steps.shard_batch(b, mesh) for b in random_batches("mlp", 2, 16, 1)]
    plain = state
    for b in batches:
        plain = step(plain, b)[0]
    sched = jaxsched.schedule(step, strategy="dear")
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsched.FallbackWarning)
        s = sched.init(state)
        for b in batches:
            s, _ = sched(s, b)
        found = collectives(sched.lower(s, batches[0]).as_text())
    assert sorted(sched.program.planned.paths) == sorted(f"params/{p}" for p in zoo_paths(params))
    assert len(found["all_gather"]) == len(found["reduce_scatter"]) == 1
    assert set(found["all_reduce"]) == {1}
    assert_trees_close(jax.device_get(sched.finalize(s)), jax.device_get(plain), rtol=1e-5, atol=1e-6)


def _pmean_step_under_dear(model, tx, seed):
    """A shard_map step that pmeans its gradients, run 3 steps plain and under dear:
    ``(params, plain end state, schedule, its state, batches)``."""
    params, apply_fn = build(model, 0)
    mesh = _mesh()

    def body(params, opt_state, batch):
        x, y = batch
        loss_fn = lambda q: optax.softmax_cross_entropy_with_integer_labels(apply_fn(q, x), y).mean()
        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt_state = tx.update(lax.pmean(g, "data"), opt_state, params)
        return optax.apply_updates(params, u), opt_state, lax.pmean(loss, "data")

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()), check_vma=False)
    )
    batches = [steps.shard_batch(b, mesh) for b in random_batches(model, 3, 16, seed)]
    plain = (params, tx.init(params))
    for b in batches:
        *plain, _ = step(*plain, b)
    sched = jaxsched.schedule(step, strategy="dear")
    s = sched.init(params, tx.init(params))
    for b in batches:
        s, _ = sched(s, b)
    return params, plain, sched, s, batches


@pytest.mark.slow
def test_global_norm_clipping_on_shards_is_one_scalar_all_reduce():
    """clip_by_global_norm sums each leaf's squares on its shard: the per-leaf sums over
    devices are batched into one all-reduce (there was one per leaf), with the plain step's
    numbers up to rounding."""
    params, plain, sched, s, batches = _pmean_step_under_dear(
        "transformer", optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3)), seed=1
    )
    found = collectives(sched.lower(s, batches[0]).as_text())
    scalars = [n for n in found["all_reduce"] if n <= len(jax.tree.leaves(params))]
    assert len(jax.tree.leaves(params)) > 10 and len(scalars) <= 2, found["all_reduce"]
    assert_trees_close(jax.device_get(sched.finalize(s)), jax.device_get(tuple(plain)), rtol=1e-5, atol=1e-6)


def test_lamb_trust_ratios_on_shards_are_one_all_reduce_per_norm_level():
    """LAMB's trust ratio reads each leaf's two norms, the second masked by the first: the
    first norms of every leaf go in one all-reduce, the second in another (there were two
    per leaf and norm)."""
    params, plain, sched, s, batches = _pmean_step_under_dear("mlp", optax.lamb(1e-2), seed=5)
    leaves = len(jax.tree.leaves(params))
    scalars = [n for n in collectives(sched.lower(s, batches[0]).as_text())["all_reduce"] if n <= 4 * leaves]
    assert len(scalars) <= 3, scalars  # two levels of norms and the loss
    assert_trees_close(jax.device_get(sched.finalize(s)), jax.device_get(tuple(plain)), rtol=1e-5, atol=1e-6)


def zoo_paths(params):
    return jaxsched.core._bucketing.param_paths(params)


def _reversed_rows(updates):
    return jax.tree.map(lambda u: u + lax.rev(u, (0,)), updates)


def test_bucket_report_names_the_bucket_whose_update_fell_back():
    params, apply_fn = build("mlp", 0)
    only_head = lambda p: {k: jax.tree.map(lambda _: k == "head", v) for k, v in p.items()}
    tx = optax.chain(optax.masked(optax.stateless(lambda u, p: _reversed_rows(u)), only_head), optax.sgd(0.1))
    mesh = _mesh()
    step = steps.make_step(apply_fn, tx, mesh)
    batch = steps.shard_batch(next(random_batches("mlp", 1, 16, 1)), mesh)
    sched = jaxsched.schedule(step, strategy="dear", buckets=[["head"], ["hidden"]])
    with pytest.warns(jaxsched.FallbackWarning, match="rev at .*test_dear_optimizers"):
        state, _ = sched(sched.init(params, tx.init(params)), batch)
    report = {r.params[0].split("/")[0]: r for r in sched.program.bucket_report}
    assert report["hidden"].on_shards and report["hidden"].fallbacks == ()
    assert not report["head"].on_shards
    assert [p for p, _ in report["head"].fallbacks] == ["rev"]
    assert "test_dear_optimizers.py" in report["head"].fallbacks[0][1]


def test_jmp_style_loss_scaling_checks_finiteness_with_one_scalar_reduction():
    """jmp's pattern: ``all_finite`` over the unscaled gradients (a stack of per-leaf
    checks), ``select_tree`` with ``lax.select``, the scale adjusted in the optimizer state."""
    params, apply_fn = build("mlp", 0)
    tx = optax.adam(zoo.SCHEDULE)

    def local(p, s, batch):
        (inner, scale), (x, y) = s, batch
        loss_fn = lambda q: optax.softmax_cross_entropy_with_integer_labels(apply_fn(q, x), y).mean() * scale
        loss, g = jax.value_and_grad(loss_fn)(p)
        g = lax.pmean(jax.tree.map(lambda t: t / scale, g), "data")
        finite = jnp.stack([jnp.all(jnp.isfinite(t)) for t in jax.tree.leaves(g)]).all()
        u, new_inner = tx.update(g, inner, p)
        select = lambda new, old: jax.tree.map(lambda a, b: lax.select(finite, a, b), new, old)
        new_scale = jnp.where(finite, scale, scale / 2)
        return (
            select(optax.apply_updates(p, u), p),
            (select(new_inner, inner), new_scale),
            lax.pmean(loss, "data") / scale,
        )

    _, found = _check(local, params, (tx.init(params), jnp.float32(2.0**8)))
    assert len(found["all_gather"]) == len(found["reduce_scatter"]) == 1
    assert set(found["all_reduce"]) == {1}
