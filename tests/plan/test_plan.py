"""Planners: optimal == brute force, optimal never worse, planner shapes."""

from __future__ import annotations

import math
import random

import pytest

from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
from jaxsched.plan import PLANNERS, plan_buckets
from jaxsched.plan._optimal import all_partitions
from jaxsched.sim import check_buckets, simulate, wfbp_time
from support.profiles import random_layers, random_network


@pytest.mark.parametrize("seed", range(30))
def test_optimal_equals_brute_force_for_wfbp(seed):
    rng = random.Random(seed)
    layers, net = random_layers(rng, rng.randint(1, 12)), random_network(rng)
    best = min(wfbp_time(layers, net, b) for b in all_partitions(len(layers)))
    planned = plan_buckets(layers, net, "optimal", strategy="wfbp")
    assert math.isclose(wfbp_time(layers, net, planned), best, rel_tol=1e-12)
    assert math.isclose(simulate(layers, net, "wfbp", planned).iteration_s, best, rel_tol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_optimal_equals_brute_force_for_dear_and_approx(seed):
    rng = random.Random(50 + seed)
    layers, net = random_layers(rng, rng.randint(1, 7)), random_network(rng)
    for strategy in ("dear", "approx"):
        best = min(
            simulate(layers, net, strategy, b, iterations=6, keep_spans=False).iteration_s
            for b in all_partitions(len(layers))
        )
        planned = plan_buckets(layers, net, "optimal", strategy=strategy)
        got = simulate(layers, net, strategy, planned, iterations=6).iteration_s
        assert math.isclose(got, best, rel_tol=1e-12), strategy


@pytest.mark.parametrize("seed", range(12))
def test_optimal_is_never_worse_than_any_planner(seed):
    rng = random.Random(100 + seed)
    layers, net = random_layers(rng, rng.randint(1, 40)), random_network(rng)
    for strategy in ("wfbp", "dear", "approx"):
        optimal = simulate(
            layers, net, strategy, plan_buckets(layers, net, "optimal", strategy), iterations=6
        ).iteration_s
        for planner in PLANNERS:
            other = simulate(
                layers, net, strategy, plan_buckets(layers, net, planner, strategy), iterations=6
            ).iteration_s
            assert optimal <= other * (1 + 1e-12), (strategy, planner)


@pytest.mark.parametrize("planner", PLANNERS)
def test_every_planner_returns_a_forward_order_partition(planner):
    rng = random.Random(1)
    layers, net = random_layers(rng, 25), random_network(rng)
    buckets = plan_buckets(layers, net, planner)
    assert check_buckets(buckets, 25) == buckets


def test_threshold_closes_buckets_in_backward_order():
    layers = LayerProfile([Layer(str(i), 1, size, 1e-3, 1e-3) for i, size in enumerate([5, 5, 5, 30, 5])])
    # backward: 4 (5B), 3 (30B) -> 35 >= 20 closes; then 2, 1, 0.
    assert plan_buckets(layers, network_preset("10gbe", 4), "threshold", threshold_bytes=20) == [[0, 1, 2], [3, 4]]


def test_mgwfbp_merges_only_when_latency_dominates():
    net = network_preset("10gbe", 16)  # all-reduce alpha = 30 * 25 us = 0.75 ms
    tiny_gaps = LayerProfile([Layer(str(i), 1, 400, 1e-3, 1e-5) for i in range(6)])
    big_gaps = LayerProfile([Layer(str(i), 1, 400, 1e-3, 5e-2) for i in range(6)])
    assert plan_buckets(tiny_gaps, net, "mgwfbp") == [list(range(6))]
    assert plan_buckets(big_gaps, net, "mgwfbp") == [[i] for i in range(6)]


def test_prophet_groups_gradients_waiting_for_the_link():
    net = network_preset("1gbe", 8)
    layers = LayerProfile([Layer(str(i), 1, 10**6, 1e-3, 1e-3) for i in range(4)])
    # Layer 3 goes alone at 1 ms; its 1 MB all-reduce (~14 ms) outlasts the rest of backward.
    assert plan_buckets(layers, net, "prophet") == [[0, 1, 2], [3]]


def test_optimal_plans_1000_layers_quickly():
    import time

    rng = random.Random(0)
    layers, net = random_layers(rng, 1000), network_preset("10gbe", 64)
    start = time.perf_counter()
    buckets = plan_buckets(layers, net, "optimal", strategy="wfbp")
    assert time.perf_counter() - start < 1.0
    assert check_buckets(buckets, 1000) == buckets


def test_unknown_planner_is_named():
    layers = LayerProfile([Layer("a", 1, 4, 1e-3, 1e-3)])
    with pytest.raises(ValueError, match="planner 'best'"):
        plan_buckets(layers, network_preset("10gbe", 2), "best")
