"""Steps as people write them: each strategy is exact (rtol 1e-5) against the plain step on
fresh random inputs, or refuses with an error naming the cause. Never wrong numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxsched
from support.equivalence import assert_trees_close

DEVICES = 4
# dear (sharded state, the riskier rewrite) runs in `make test`; wfbp in `make test-slow`.
STRATEGIES = [pytest.param("wfbp", marks=pytest.mark.slow), "dear"]
TX = optax.adam(1e-2)


def _params(seed):
    rng = np.random.default_rng(seed)
    return {
        "dense": {"kernel": rng.standard_normal((6, 5)).astype(np.float32) * 0.3, "bias": np.zeros(5, np.float32)},
        "head": {"kernel": rng.standard_normal((5, 3)).astype(np.float32) * 0.3},
    }


def _batches(seed, n=5, rows=8):
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((rows, 6)).astype(np.float32), rng.integers(0, 3, rows).astype(np.int32)) for _ in range(n)
    ]


def _xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def _forward(p, x, stats_fn=None):
    h = x @ p["dense"]["kernel"] + p["dense"]["bias"]
    if stats_fn is not None:
        h = stats_fn(h)
    return jnp.tanh(h) @ p["head"]["kernel"]


def _run(step, state, batches, place, strategy):
    plain, plain_aux = state, []
    for b in batches:
        *plain, aux = step(*plain, place(b))
        plain_aux.append(jax.device_get(aux))
    sched = jaxsched.schedule(step, strategy=strategy, buckets=1)
    st, sched_aux = sched.init(*state), []
    for b in batches:
        st, aux = sched(st, place(b))
        sched_aux.append(jax.device_get(jax.block_until_ready(aux)))
    assert_trees_close(tuple(plain), sched.finalize(st))
    assert_trees_close(plain_aux, sched_aux)
    return sched


def _shard_map_step(body, state_specs=(P(), P())):
    mesh = jax.make_mesh((DEVICES,), ("data",), devices=jax.devices()[:DEVICES])
    step = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(*state_specs, P("data")), out_specs=(*state_specs, P()), check_vma=False
        )
    )
    place = lambda b: jax.device_put(b, jax.NamedSharding(mesh, P("data")))
    return step, place, mesh


# -- collectives whose results forward or backward read ------------------------------------
def _syncbn_body(p, s, batch):
    x, y = batch

    def stats(h):  # synchronized batch norm: batch statistics pmean'ed in forward
        mean = lax.pmean(jnp.mean(h, 0), "data")
        var = lax.pmean(jnp.mean((h - mean) ** 2, 0), "data")
        return (h - mean) * lax.rsqrt(var + 1e-5)

    loss, g = jax.value_and_grad(lambda q: _xent(_forward(q, x, stats), y))(p)
    g = lax.pmean(g, "data")
    u, s = TX.update(g, s, p)
    return optax.apply_updates(p, u), s, {"loss": lax.pmean(loss, "data")}


def _token_count_body(p, s, batch):
    x, y = batch
    mask = (y != 0).astype(jnp.float32)
    count = lax.psum(jnp.sum(mask), "data")  # the global token count, used in the loss

    def loss_fn(q):
        logp = jax.nn.log_softmax(_forward(q, x))
        return -jnp.sum(jnp.take_along_axis(logp, y[:, None], 1)[:, 0] * mask) / count

    loss, g = jax.value_and_grad(loss_fn)(p)
    g = lax.psum(g, "data")
    u, s = TX.update(g, s, p)
    return optax.apply_updates(p, u), s, {"loss": lax.psum(loss, "data")}


def _sam_body(p, s, batch):
    x, y = batch
    loss_fn = lambda q: _xent(_forward(q, x), y)
    g = lax.pmean(jax.grad(loss_fn)(p), "data")
    norm = jnp.sqrt(sum(jnp.sum(v**2) for v in jax.tree.leaves(g)))
    perturbed = jax.tree.map(lambda a, b: a + 0.05 * b / (norm + 1e-12), p, g)
    loss, g2 = jax.value_and_grad(loss_fn)(perturbed)
    g2 = lax.pmean(g2, "data")
    u, s = TX.update(g2, s, p)
    return optax.apply_updates(p, u), s, {"loss": lax.pmean(loss, "data")}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("body", [_syncbn_body, _token_count_body, _sam_body], ids=["syncbn", "token_count", "sam"])
def test_collectives_in_forward_stay_where_they_are(body, strategy):
    step, place, _ = _shard_map_step(body)
    params = _params(0)
    sched = _run(step, (params, TX.init(params)), _batches(1), place, strategy)
    assert len(sched.program.planned.analysis.reductions) == 3  # only the gradient reductions


# -- state that differs per device ----------------------------------------------------------
def _pmap_key_body(p, s, batch):
    """A per-device RNG key in the params tree: dropout noise differs per device."""
    x, y = batch
    key, sub = jax.random.split(p["rng"])
    noise = jax.random.bernoulli(sub, 0.8, x.shape).astype(x.dtype) / 0.8
    weights = {k: v for k, v in p.items() if k != "rng"}
    loss, g = jax.value_and_grad(lambda q: _xent(_forward(q, x * noise), y))(weights)
    g = lax.pmean(g, "data")
    u, s = TX.update(g, s, weights)
    new = optax.apply_updates(weights, u)
    return {**new, "rng": key}, s, {"loss": lax.pmean(loss, "data")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_per_device_rng_key_in_pmap_params_stays_per_device(strategy):
    devices = jax.devices()[:DEVICES]
    step = jax.pmap(_pmap_key_body, axis_name="data", devices=devices)
    weights = _params(0)
    keys = jax.random.split(jax.random.PRNGKey(3), DEVICES)
    params = {**jax.tree.map(lambda a: np.stack([a] * DEVICES), weights), "rng": np.asarray(keys)}
    opt = jax.tree.map(lambda a: np.stack([np.asarray(a)] * DEVICES), TX.init(weights))
    place = lambda b: jax.tree.map(lambda a: a.reshape(DEVICES, -1, *a.shape[1:]), b)
    _run(step, (params, opt), _batches(2), place, strategy)


def _bn_stats_body(p, s, batch):
    """Per-device batch-norm running statistics carried in opt_state (not synchronized)."""
    x, y = batch
    opt, stats = s
    h = x @ p["dense"]["kernel"]
    new_stats = 0.9 * stats + 0.1 * jnp.mean(h, 0)  # differs per device
    loss, g = jax.value_and_grad(lambda q: _xent(_forward(q, x - stats[None, :1]), y))(p)
    g = lax.pmean(g, "data")
    u, opt = TX.update(g, opt, p)
    return optax.apply_updates(p, u), (opt, new_stats), {"loss": lax.pmean(loss, "data")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_device_bn_statistics_in_pmap_state_stay_per_device(strategy):
    devices = jax.devices()[:DEVICES]
    step = jax.pmap(_bn_stats_body, axis_name="data", devices=devices)
    params = _params(0)
    state = jax.tree.map(
        lambda a: np.stack([np.asarray(a)] * DEVICES), (params, (TX.init(params), np.zeros(5, np.float32)))
    )
    place = lambda b: jax.tree.map(lambda a: a.reshape(DEVICES, -1, *a.shape[1:]), b)
    _run(step, state, _batches(4), place, strategy)


def _typed_key_body(p, s, batch):
    x, y = batch
    key, sub = jax.random.split(p["key"])
    scale = 1.0 + 0.01 * jax.random.normal(sub, ())
    weights = {k: v for k, v in p.items() if k != "key"}
    loss, g = jax.value_and_grad(lambda q: _xent(_forward(q, x * scale), y))(weights)
    g = lax.pmean(g, "data")
    u, s = TX.update(g, s, weights)
    return {**optax.apply_updates(weights, u), "key": key}, s, {"loss": lax.pmean(loss, "data")}


@pytest.mark.parametrize("strategy", STRATEGIES + [pytest.param("allreduce", marks=pytest.mark.slow)])
def test_a_typed_key_and_an_integer_counter_pass_through(strategy):
    step, place, _ = _shard_map_step(_typed_key_body)
    weights = _params(0)
    params = {**weights, "key": jax.random.key(5)}
    state = (params, TX.init(weights))
    plain = state
    for b in _batches(5):
        *plain, _ = step(*plain, place(b))
    sched = jaxsched.schedule(step, strategy=strategy, buckets=1)
    st = sched.init(*state)
    for b in _batches(5):
        st, _ = sched(st, place(b))
    got = sched.finalize(st)
    assert jnp.array_equal(jax.random.key_data(got[0]["key"]), jax.random.key_data(plain[0]["key"]))
    assert_trees_close(
        {k: v for k, v in plain[0].items() if k != "key"}, {k: v for k, v in got[0].items() if k != "key"}
    )
    assert_trees_close(plain[1], got[1])


def _sharded_key_body(p, s, batch):
    """State with a non-replicated spec: a per-device key, sharded P('data')."""
    weights, keys = p
    x, y = batch
    key, sub = jax.random.split(keys[0])
    noise = 1.0 + 0.1 * jax.random.normal(sub, x.shape)
    loss, g = jax.value_and_grad(lambda q: _xent(_forward(q, x * noise), y))(weights)
    g = lax.pmean(g, "data")
    u, s = TX.update(g, s, weights)
    return (optax.apply_updates(weights, u), key[None]), s, {"loss": lax.pmean(loss, "data")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_state_leaf_with_a_sharded_spec_keeps_its_spec(strategy):
    step, place, mesh = _shard_map_step(_sharded_key_body, state_specs=((P(), P("data")), P()))
    weights = _params(0)
    keys = jax.device_put(jax.random.split(jax.random.PRNGKey(0), DEVICES), jax.NamedSharding(mesh, P("data")))
    _run(step, ((weights, keys), TX.init(weights)), _batches(6), place, strategy)
