"""pmap steps as public code writes them, each against its ``shard_map`` twin: the same
trained leaves, buckets and collectives under ``dear``, and the plain step's numbers.

The patterns: state replicated with a leading device axis (Flax's ``jax_utils.replicate``),
an unmapped argument (``in_axes=None``, as AlgoPerf passes hyperparameters), and a constant
JAX hoists into the body (a position table closed over by the model); and the state
passed whole (``in_axes=None``, ``out_axes=None``)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxsched
from support.equivalence import assert_trees_close
from support.hlo_counts import counts

N = 4
TX = optax.adamw(1e-2, weight_decay=1e-2)
TABLE = np.linspace(0.0, 1.0, 6, dtype=np.float32)  # a numpy constant: hoisted into the body


def _state():
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.standard_normal((6, 16)).astype(np.float32),
        "b1": np.zeros(16, np.float32),
        "w2": rng.standard_normal((16, 3)).astype(np.float32),
    }
    return {"params": params, "opt": TX.init(params), "step": np.int32(0)}


def _body(with_table: bool):
    def body(state, batch):
        x, y, scale = batch

        def loss_fn(p):
            h = jnp.tanh((x + TABLE if with_table else x) @ p["w1"] + p["b1"])
            return jnp.mean((h @ p["w2"] - y) ** 2) * scale

        loss, g = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = TX.update(lax.pmean(g, "data"), state["opt"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}
        return new, lax.pmean(loss, "data")

    return body


def _batches(n=2):
    rng = np.random.default_rng(1)
    return [
        (
            rng.standard_normal((N * 2, 6)).astype(np.float32),
            rng.standard_normal((N * 2, 3)).astype(np.float32),
            np.float32(1.0),
        )
        for _ in range(n)
    ]


def _twins(pattern: str):
    """(pmap step, its state, its batches), (shard_map step, state, batches)."""
    with_table = pattern == "hoisted constant"
    body = _body(with_table)
    devices = jax.devices()[:N]
    mesh = jax.make_mesh((N,), ("data",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
    sm = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(), (P("data"), P("data"), P())), out_specs=(P(), P()), check_vma=False
        )
    )
    sm_batches = [
        (jax.device_put(x, NamedSharding(mesh, P("data"))), jax.device_put(y, NamedSharding(mesh, P("data"))), s)
        for x, y, s in _batches()
    ]
    split = lambda a: a.reshape(N, -1, *a.shape[1:])
    if pattern == "unmapped state":  # the state whole in and out (in_axes/out_axes None)
        pm = jax.pmap(body, axis_name="data", in_axes=(None, (0, 0, None)), out_axes=None, devices=devices)
        return (pm, _state(), [(split(x), split(y), s) for x, y, s in _batches()]), (sm, _state(), sm_batches)
    in_axes = (0, (0, 0, None)) if pattern == "unmapped argument" else 0
    pm = jax.pmap(body, axis_name="data", in_axes=in_axes, devices=devices)
    stack = lambda tree: jax.tree.map(lambda a: np.stack([np.asarray(a)] * N), tree)
    pm_batches = [
        (split(x), split(y), s if pattern == "unmapped argument" else np.full(N, s)) for x, y, s in _batches()
    ]
    return (pm, stack(_state()), pm_batches), (sm, _state(), sm_batches)


def _scheduled(step, state, batches, **options):
    sched = jaxsched.schedule(step, strategy="dear", **options)
    s = sched.init(state)
    for b in batches:
        s, _ = sched(s, b)
    return sched, s


PATTERNS = ["replicated state", "unmapped argument", "unmapped state", "hoisted constant"]
PLAN = [["params/w1"], ["params/b1", "params/w2"]]  # an explicit plan, by path
CASES = (
    [(pattern, 300) for pattern in PATTERNS]
    + [
        pytest.param(pattern, None, marks=() if pattern == "replicated state" else pytest.mark.slow)
        for pattern in PATTERNS
    ]
    + [("replicated state", PLAN)]
)


@pytest.mark.parametrize("pattern,buckets", CASES)
def test_pmap_step_schedules_like_its_shard_map_twin(pattern, buckets):
    (pm, pm_state, pm_batches), (sm, sm_state, sm_batches) = _twins(pattern)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsched.FallbackWarning)
        pm_sched, pm_s = _scheduled(pm, pm_state, pm_batches, buckets=buckets)
        sm_sched, sm_s = _scheduled(sm, sm_state, sm_batches, buckets=buckets)
    pm_prog, sm_prog = pm_sched.program, sm_sched.program
    assert pm_prog.captured.kind == "pmap"
    assert sorted(pm_prog.planned.paths) == sorted(sm_prog.planned.paths) == ["params/b1", "params/w1", "params/w2"]
    assert [b.params for b in pm_prog.buckets] == [b.params for b in sm_prog.buckets]
    assert len(pm_prog.buckets) == (1 if buckets is None else 2)
    if buckets == PLAN:
        assert sorted(sorted(pm_prog.planned.paths[i] for i in b.params) for b in pm_prog.buckets) == sorted(
            sorted(group) for group in PLAN
        )
    assert counts(pm_sched.lower(pm_s, pm_batches[0]).as_text()) == counts(
        sm_sched.lower(sm_s, sm_batches[0]).as_text()
    )
    plain = pm_state
    for b in pm_batches:
        plain, _ = pm(plain, b)
    assert_trees_close(pm_sched.finalize(pm_s), jax.device_get(plain), rtol=1e-5, atol=1e-6)


def test_algoperf_style_step_stays_on_shards():
    """AlgoPerf's pmapped step: state mapped, hyperparameters unmapped, the loss, the count
    of valid examples and the gradients summed in one psum, gradients divided by the count,
    clipped by their global norm, and a NAdam chain with masked weight decay."""
    from support.equivalence import build, random_batches
    import support.optimizer_zoo as zoo

    params, apply_fn = build("mlp", 0)
    tx = optax.chain(
        optax.scale_by_adam(nesterov=True),
        optax.add_decayed_weights(1e-2, mask=zoo.decay_mask),
        optax.scale_by_learning_rate(zoo.SCHEDULE),
    )

    def train_step(params, opt_state, batch, grad_clip, label_smoothing):
        x, y = batch
        mask = (y >= 0).astype(jnp.float32)

        def loss_fn(p):
            targets = optax.smooth_labels(jax.nn.one_hot(y, 10), label_smoothing)
            return jnp.sum(optax.softmax_cross_entropy(apply_fn(p, x), targets) * mask), jnp.sum(mask)

        (summed, n_valid), grad = jax.value_and_grad(loss_fn, has_aux=True)(params)
        summed, n_valid, grad = lax.psum((summed, n_valid, grad), axis_name="batch")
        grad = jax.tree.map(lambda g: g / n_valid, grad)
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grad)))
        grad = jax.tree.map(lambda g: g * grad_clip / jnp.maximum(norm, grad_clip), grad)
        updates, opt_state = tx.update(grad, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, (summed / n_valid, norm)

    pmapped = jax.pmap(train_step, axis_name="batch", in_axes=(0, 0, 0, None, None), devices=jax.devices()[:N])
    step = lambda p, o, b: pmapped(p, o, b, 1.0, 0.1)
    stack = lambda t: jax.tree.map(lambda a: np.stack([np.asarray(a)] * N), t)
    start = (stack(params), stack(tx.init(params)))
    batches = [jax.tree.map(lambda a: a.reshape(N, -1, *a.shape[1:]), b) for b in random_batches("mlp", 2, 2 * N, 1)]
    plain = start
    for b in batches:
        plain = step(*plain, b)[:2]
    sched = jaxsched.schedule(step, strategy="dear")
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxsched.FallbackWarning)
        state = sched.init(*start)
        for b in batches:
            state, _ = sched(state, b)
        found = counts(sched.lower(state, batches[0]).as_text())
    assert sched.program.captured.kind == "pmap"
    assert found["all_gather"] == found["reduce_scatter"] == 1
    assert_trees_close(jax.device_get(sched.finalize(state)), jax.device_get(plain), rtol=1e-5, atol=1e-6)
