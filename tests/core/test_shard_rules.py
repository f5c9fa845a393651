"""Shard rules one by one: a function run on chunks (``eval_sharded``) equals it on full
tensors, with no fallback, on shapes that do not divide by the number of devices."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsched.core import _layout as layout
from jaxsched.core.rewrite._rules import FallbackWarning, Shard, ShardContext, eval_sharded

N = 4
SHAPE = (5, 3)  # 15 elements: padded to 16 over 4 devices


def _on_shards(fn, *full):
    """``fn`` on every argument's chunks, its outputs gathered back; and ``fn`` itself."""
    mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
    closed = jax.make_jaxpr(fn)(*full)

    def body(*args):
        ctx = ShardContext("data", N)
        shards = [Shard(layout.local_chunk(a, "data", N), a.shape) for a in args]
        outs = eval_sharded(ctx, closed.jaxpr, shards, closed.consts)
        return tuple(ctx.to_full(o) for o in outs)

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(),) * len(full), out_specs=P(), check_vma=False))
    placed = [jax.device_put(a, NamedSharding(mesh, P())) for a in full]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        got = run(*placed)
    return got, fn(*full)


FUNCTIONS = {
    "row sums": lambda x: jnp.sum(x**2, axis=1),
    "column means": lambda x: jnp.mean(x, axis=0),
    "row max": lambda x: jnp.max(x, axis=1),
    "column min": lambda x: jnp.min(x, axis=0),
    "factored outer product": lambda x: x * jnp.mean(x, axis=1, keepdims=True) * jnp.mean(x, axis=0),
    "all finite": lambda x: jnp.all(jnp.isfinite(x)),
    "any nan": lambda x: jnp.any(jnp.isnan(x)),
    "zero nans": lambda x: jnp.where(jnp.isnan(x), 0.0, x),
    "cond on a global norm": lambda x: lax.cond(jnp.sum(x**2) > 1.0, lambda a: a * 2.0, lambda a: a - 1.0, x),
    "fori_loop": lambda x: lax.fori_loop(0, 3, lambda i, a: a * 0.5 + jnp.float32(i), x),
    "scan with a full input": lambda x: lax.scan(lambda c, t: (c * t + 1.0, jnp.sum(c)), x, jnp.arange(3.0))[0],
    "scan growing a sharded carry": lambda x: lax.fori_loop(
        0, 2, lambda i, c: (c[0] + x, c[1] + 1.0), (jnp.zeros(SHAPE), 0.0)
    )[0],
    "switch": lambda x: lax.switch(jnp.int32(jnp.sum(x) > 0), [lambda a: a, lambda a: jnp.sqrt(jnp.abs(a))], x),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_rule_matches_the_full_computation(name):
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    (got,), want = _on_shards(lambda a: (FUNCTIONS[name](a),), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want[0]), rtol=1e-6, atol=1e-6)


def test_boolean_reductions_see_every_device():
    x = np.ones(SHAPE, np.float32)
    x[4, 2] = np.nan  # the last real element, on the last device
    (finite, nan), _ = _on_shards(lambda a: (jnp.all(jnp.isfinite(a)), jnp.any(jnp.isnan(a))), x)
    assert not bool(finite) and bool(nan)
