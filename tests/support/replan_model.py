"""A smooth model and two networks for re-planning tests (shared by the multi-process worker).

tanh, not ReLU: a rounding-sized difference that crosses a ReLU kink grows past any
tolerance even when a switch is exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsched.sim._costmodel import COLLECTIVES, CollectiveCost, Layer, LayerProfile, NetworkProfile

WIDTHS = (6, 24, 24, 24, 24, 4)


def tanh_mlp(seed: int = 0):
    """Params ``{"l0": {"w", "b"}, ...}`` and ``apply(params, x)``."""
    rng = np.random.default_rng(seed)
    params = {
        f"l{k}": {
            "w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.asarray(0.1 * rng.standard_normal(b), jnp.float32),
        }
        for k, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:]))
    }

    def apply(p, x):
        for k in range(len(WIDTHS) - 1):
            x = x @ p[f"l{k}"]["w"] + p[f"l{k}"]["b"]
            if k < len(WIDTHS) - 2:
                x = jnp.tanh(x)
        return x

    return params, apply


def layer_profile() -> LayerProfile:
    """Fixed compute times, so that the plan depends on the network alone."""
    layers = [
        Layer(f"l{k}", a * b + b, 4 * (a * b + b), 1e-3, 2e-3) for k, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:]))
    ]
    return LayerProfile(layers, {"source": "test"})


def network(workers: int, alpha_s: float, beta_s_per_byte: float) -> NetworkProfile:
    return NetworkProfile(
        workers, {n: CollectiveCost(alpha_s, beta_s_per_byte) for n in COLLECTIVES}, {"source": "test"}
    )


def latency_bound(workers: int) -> NetworkProfile:
    """A start-up cost that dwarfs compute: one bucket."""
    return network(workers, 1.0, 1e-12)


def bandwidth_bound(workers: int) -> NetworkProfile:
    """No start-up cost, bytes that take as long as compute: a bucket per layer overlaps most."""
    return network(workers, 0.0, 2e-3 / (4 * 24 * 24))


def batches(n: int, size: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield (
            rng.standard_normal((size, WIDTHS[0])).astype(np.float32),
            rng.integers(0, WIDTHS[-1], size).astype(np.int32),
        )


def optimizer() -> optax.GradientTransformation:
    return optax.adam(1e-2)


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]
