"""Random profiles shared by the simulator and planner tests."""

from __future__ import annotations

import random
from fractions import Fraction

from jaxsched.sim._costmodel import CollectiveCost, Layer, LayerProfile, NetworkProfile


def random_layers(rng: random.Random, num: int, exact: bool = False, with_update: bool = True) -> LayerProfile:
    """Times in [0.1, 10] ms (Fractions when ``exact``), sizes 0..40 MB incl. empty layers."""

    def seconds():
        return Fraction(rng.randint(1, 100), 10_000) if exact else rng.uniform(1e-4, 1e-2)

    layers = []
    for i in range(num):
        size = 0 if rng.random() < 0.1 else rng.randint(1, 10_000_000) * 4
        update = seconds() if with_update and rng.random() < 0.5 else 0
        layers.append(Layer(f"l{i}", size // 4, size, seconds(), seconds(), update))
    return LayerProfile(layers)


def random_network(rng: random.Random, exact: bool = False) -> NetworkProfile:
    """Alpha 0..5 ms, beta for 0.1..10 GB/s, independent per collective."""
    costs = {}
    for name in ("all_reduce", "reduce_scatter", "all_gather", "ppermute"):
        if exact:
            costs[name] = CollectiveCost(Fraction(rng.randint(0, 50), 10_000), Fraction(1, rng.randint(10**8, 10**10)))
        else:
            costs[name] = CollectiveCost(rng.uniform(0, 5e-3), 1 / rng.uniform(1e8, 1e10))
    return NetworkProfile(rng.choice([2, 3, 8, 64]), costs)
