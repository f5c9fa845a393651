"""What packing a bucket into one buffer costs on XLA:CPU, against an elementwise pass.

Run from the repository root: ``.venv/bin/python benchmarks/pack_copies.py``
(one core; 16 leaves of an 8x1024 MLP's gradients, 33.6 MB; medians of 8 calls). Writes
``benchmarks/results/pack_copies.json``. Behind ``Collective.all_reduce_tensors``: the
plain psum reduces large tensors as they are instead of packing them.
"""

import json
import os
import statistics
import time
from pathlib import Path

os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

LEAVES = [jnp.full((1024, 1024), float(i)) for i in range(8)] + [jnp.ones(1024)] * 8


@jax.jit
def concatenate(leaves):
    return jnp.concatenate([x.ravel() for x in leaves])


@jax.jit
def update_slices(leaves):
    buf, offset = jnp.zeros(sum(x.size for x in leaves)), 0
    for x in leaves:
        buf = lax.dynamic_update_slice(buf, x.ravel(), (offset,))
        offset += x.size
    return buf


def split(scale: float):
    @jax.jit
    def run(buf):
        out, offset = [], 0
        for x in LEAVES:
            out.append(buf[offset : offset + x.size].reshape(x.shape) * scale)
            offset += x.size
        return out

    return run


tx = optax.sgd(1e-3, momentum=0.9)


@jax.jit
def momentum_update(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def median_ms(call) -> float:
    times = []
    for _ in range(9):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


buffer = concatenate(LEAVES)
state = tx.init(LEAVES)
slice_back, slice_back_half = split(1.0), split(0.5)
plus_one = jax.jit(lambda leaves: [x + 1 for x in leaves])
result = {
    "concatenate_ms": median_ms(lambda: concatenate(LEAVES)),
    "dynamic_update_slice_chain_ms": median_ms(lambda: update_slices(LEAVES)),
    "slice_back_ms": median_ms(lambda: slice_back(buffer)),
    "slice_back_times_half_ms": median_ms(lambda: slice_back_half(buffer)),
    "elementwise_plus_one_ms": median_ms(lambda: plus_one(LEAVES)),
    "sgd_momentum_update_ms": median_ms(lambda: momentum_update(LEAVES, state, LEAVES)),
}
out = Path(__file__).resolve().parent / "results" / "pack_copies.json"
out.write_text(json.dumps(result, indent=1))
print({k: round(v, 1) for k, v in result.items()})
