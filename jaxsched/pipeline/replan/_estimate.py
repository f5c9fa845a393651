"""The network estimate of re-planning: sliding windows of timings, α-β fits, and the
networks and drift they give (pure functions of numbers, no devices).

Example:
    >>> w = update_window({}, {"all_reduce": {100: [2.0], 300: [4.0]}}, 3, 0.2)
    >>> cost = fit_window(w)["all_reduce"]
    >>> round(cost.alpha_s, 6), round(cost.beta_s_per_byte, 6)
    (1.0, 0.01)
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Mapping, Sequence

import numpy as np

from jaxsched.sim._costmodel import CollectiveCost, NetworkProfile

__all__ = [
    "bucket_groups",
    "drift_between",
    "fit_window",
    "measured_network",
    "merge_samples",
    "Samples",
    "scaled_network",
    "update_window",
    "window_ratio",
    "without_engine_costs",
]


Samples = Mapping[str, Mapping[int, Sequence[float]]]  # collective -> bytes -> seconds


def update_window(
    window: Samples, new: Samples, size: int, drift: float, reduce: Callable[[Sequence[float]], float] = min
) -> dict:
    """The sliding window after a measurement ``new`` (per collective and probe size, its
    timings): each size keeps the fastest timing (``reduce``) of each of the last ``size``
    measurements; a collective's window restarts from ``new`` alone when at every size it lies
    outside the window's range by more than ``drift`` (a step change, not noise, which the
    range already spans).

    >>> w = update_window({}, {"all_reduce": {8: [1.0, 1.2]}}, 3, 0.2)
    >>> update_window(w, {"all_reduce": {8: [1.1, 1.5]}}, 3, 0.2)["all_reduce"][8]
    [1.0, 1.1]
    >>> update_window(w, {"all_reduce": {8: [3.0, 3.1]}}, 3, 0.2)["all_reduce"][8]
    [3.0]
    """
    out: dict = {}
    for name, sizes in new.items():
        old = window.get(name, {})
        fastest = {nbytes: reduce(times) for nbytes, times in sizes.items() if times}
        jumped = bool(fastest) and all(
            old.get(nbytes) and (t > max(old[nbytes]) * (1 + drift) or t * (1 + drift) < min(old[nbytes]))
            for nbytes, t in fastest.items()
        )
        out[name] = {
            nbytes: ([t] if jumped else list(old.get(nbytes, [])) + [t])[-size:] for nbytes, t in fastest.items()
        }
    return out


def fit_window(window: Samples) -> dict[str, CollectiveCost]:
    """α and β per collective through the window's medians (least squares, both >= 0).

    >>> cost = fit_window({"all_reduce": {100: [2.0, 2.0], 300: [4.0]}})["all_reduce"]
    >>> round(cost.alpha_s, 6), round(cost.beta_s_per_byte, 6)
    (1.0, 0.01)
    """
    from jaxsched.plan._profiling import fit_alpha_beta

    costs = {}
    for name, sizes in window.items():
        points = sorted((nbytes, statistics.median(times)) for nbytes, times in sizes.items() if times)
        if len(points) >= 2:
            costs[name] = fit_alpha_beta(*zip(*points))[0]
    return costs


def without_engine_costs(network: NetworkProfile) -> NetworkProfile:
    """``network`` less the engine's fixed cost per collective that planning added to every
    α (`jaxsched.plan._from_step.step_network_profile`): the network itself."""
    extra = float(network.meta.get("engine_per_collective_s", 0.0) or 0.0)
    if not extra:
        return network
    meta = {k: v for k, v in network.meta.items() if k != "engine_per_collective_s"}
    return dataclasses.replace(
        network,
        meta=meta,
        collectives={
            name: CollectiveCost(max(0.0, c.alpha_s - extra), c.beta_s_per_byte)
            for name, c in network.collectives.items()
        },
    )


def measured_network(basis: NetworkProfile, costs: Mapping[str, CollectiveCost]) -> NetworkProfile:
    """``basis`` with the measured collectives' costs; collectives not measured are scaled by
    the measured ones' mean β ratio (the same links carry them).

    >>> from jaxsched.sim._costmodel import network_preset
    >>> net = measured_network(network_preset("1gbe", 2), {"all_reduce": CollectiveCost(1e-4, 1.6e-7)})
    >>> round(net.cost("all_gather").beta_s_per_byte / network_preset("1gbe", 2).cost("all_gather").beta_s_per_byte)
    20
    """
    ratios = [
        costs[n].beta_s_per_byte / basis.collectives[n].beta_s_per_byte
        for n in costs
        if n in basis.collectives and basis.collectives[n].beta_s_per_byte > 0
    ]
    scale = float(np.mean(ratios)) if ratios else 1.0
    collectives = {
        name: costs.get(name, CollectiveCost(c.alpha_s, c.beta_s_per_byte * scale))
        for name, c in basis.collectives.items()
    }
    collectives.update({n: c for n, c in costs.items() if n not in collectives})
    meta = {k: v for k, v in basis.meta.items() if k not in ("preset", "fit_max_relative_error")}
    return dataclasses.replace(
        basis, collectives=collectives, meta={**meta, "source": "jaxsched.pipeline.replan (measured while training)"}
    )


def drift_between(
    assumed: NetworkProfile, measured: NetworkProfile, collectives: Sequence[str], nbytes: float
) -> float:
    """The largest relative difference, over ``collectives``, of the time one bucket of
    ``nbytes`` takes on ``measured`` against ``assumed``.

    >>> from jaxsched.sim._costmodel import network_preset
    >>> a, b = network_preset("1gbe", 2), network_preset("10gbe", 2)
    >>> round(drift_between(a, b, ["all_reduce"], 1e6), 2)
    0.9
    """
    worst = 0.0
    for name in collectives:
        before, now = assumed.time(name, nbytes), measured.time(name, nbytes)
        if before > 0:
            worst = max(worst, abs(now / before - 1.0))
    return worst


def bucket_groups(
    buckets: Sequence[Sequence[str]], members: Sequence[Sequence[int]], paths: Sequence[str]
) -> list[list[int]]:
    """A plan of parameter paths as the simulator's groups of layers (forward order): each
    layer goes to the bucket holding most of its parameters (a plan made by the planners
    never splits a layer).

    >>> bucket_groups([["b/w", "b/b"], ["a/w"]], [[2], [0, 1]], ["b/b", "b/w", "a/w"])
    [[0], [1]]
    """
    where = {p: k for k, bucket in enumerate(buckets) for p in bucket}
    owner: list[int | None] = []
    for layer in members:
        votes = [where[paths[i]] for i in layer if paths[i] in where]
        owner.append(max(set(votes), key=votes.count) if votes else None)
    # contiguous runs of layers of one bucket (a bucket split by dtype or by how its
    # gradients are reduced may hold layers apart: each run is one group)
    groups: list[list[int]] = []
    last: int | None = None
    for index, k in enumerate(owner):
        k = last if k is None else k
        if groups and k == last:
            groups[-1].append(index)
        else:
            groups.append([index])
        last = k
    return groups


def merge_samples(a: Samples, b: Samples) -> dict:
    out = {n: {k: list(v) for k, v in sizes.items()} for n, sizes in a.items()}
    for n, sizes in b.items():
        for k, v in sizes.items():
            out.setdefault(n, {}).setdefault(k, []).extend(v)
    return out


def window_ratio(reference: Samples, now: Samples) -> dict[str, float]:
    """Per collective, how much longer the same bucket sizes take now than in ``reference``:
    the sum of their medians now over the sum then (sizes in both windows only).

    >>> window_ratio({"all_reduce": {8: [1.0], 16: [2.0]}}, {"all_reduce": {16: [20.0, 20.0]}})
    {'all_reduce': 10.0}
    """
    ratios = {}
    for name, sizes in now.items():
        common = [n for n in sizes if sizes[n] and reference.get(name, {}).get(n)]
        before = sum(statistics.median(reference[name][n]) for n in common)
        if common and before > 0:
            ratios[name] = sum(statistics.median(sizes[n]) for n in common) / before
    return ratios


def scaled_network(basis: NetworkProfile, ratios: Mapping[str, float]) -> NetworkProfile:
    """``basis`` with each collective's β multiplied by its ratio (α kept: a stage's time of a
    large bucket says little about it); collectives without a ratio scale by their mean.

    >>> from jaxsched.sim._costmodel import network_preset
    >>> net = scaled_network(network_preset("1gbe", 2), {"all_reduce": 10.0})
    >>> round(net.cost("all_reduce").beta_s_per_byte / network_preset("1gbe", 2).cost("all_reduce").beta_s_per_byte)
    10
    """
    costs = {
        n: CollectiveCost(basis.collectives[n].alpha_s, basis.collectives[n].beta_s_per_byte * r)
        for n, r in ratios.items()
        if n in basis.collectives
    }
    return measured_network(basis, costs)
