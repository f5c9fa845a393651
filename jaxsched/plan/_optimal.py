"""The contiguous bucket partition that minimises the simulated iteration time.

Why: threshold and greedy planners are rules of thumb; on a given profile the best
partition can be found. For ``wfbp``/``mgwfbp`` (synchronous, FIFO link) dynamic
programming is exact: after the buckets covering the first ``j`` gradients in backward
order, the future depends only on when the link frees, ``E_j``, and later costs are
non-decreasing in it, so ``E_j = min_i max(E_i, r_j) + c(i..j)`` over the last bucket's
start ``i`` is optimal (O(L^2), vectorised over ``i``). For ``allreduce`` and ``approx``
one bucket is optimal (alpha >= 0: each iteration then costs ``max(compute, one
collective)``, the least any partition can). For ``dear`` and compressed strategies the
simulator is searched: exhaustively up to ``EXHAUSTIVE_LAYERS`` layers, otherwise the
best of every other planner and a threshold sweep, refined by merging neighbours.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import numpy as np

from jaxsched._errors import JaxschedValueError
from jaxsched.sim._costmodel import LayerProfile, NetworkProfile
from jaxsched.plan._common import backward_view, to_forward_buckets

__all__ = ["all_partitions", "EXHAUSTIVE_LAYERS", "optimal_wfbp", "search"]

EXHAUSTIVE_LAYERS = 10


def optimal_wfbp(layers: LayerProfile, network: NetworkProfile) -> tuple[list[list[int]], float]:
    """Exact DP for WFBP; returns forward-order buckets and the link-free time after backward.

    Args:
      layers: the model's layers in forward order, with their backward times and sizes.
      network: the all-reduce cost the buckets pay.

    Returns:
      ``(buckets, link_free_s)``: forward-order buckets of layer indices, and when the link
      frees after the last bucket (the quantity the partition minimises).

    Example:
        >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
        >>> prof = LayerProfile([Layer(str(i), 1, 10**6, 1e-3, 1e-3) for i in range(6)])
        >>> buckets, _ = optimal_wfbp(prof, network_preset("10gbe", 8))
        >>> sum(len(b) for b in buckets)
        6
    """
    ready, sizes = backward_view(layers)
    num = len(ready)
    cost = network.cost("all_reduce")
    ready_arr = np.asarray(ready, dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(sizes, dtype=float))])
    link_free = np.zeros(num + 1)
    choice = np.zeros(num + 1, dtype=np.int64)
    for j in range(1, num + 1):
        nbytes = prefix[j] - prefix[:j]
        comm = np.where(nbytes > 0, cost.alpha_s + cost.beta_s_per_byte * nbytes, 0.0)
        ends = np.maximum(link_free[:j], ready_arr[j - 1]) + comm
        best = int(np.argmin(ends))
        link_free[j], choice[j] = ends[best], best
    groups, j = [], num
    while j > 0:
        i = int(choice[j])
        groups.append(list(range(i, j)))
        j = i
    return to_forward_buckets(groups[::-1], num), float(link_free[num])


def all_partitions(num_layers: int):
    """Every contiguous partition of ``range(num_layers)`` (2**(n-1) of them): the search
    space of the exhaustive planner for small models.

    Args:
      num_layers: how many layers to partition (at least 1).

    Yields:
      Each partition as a list of buckets of consecutive layer indices.

    Example:
        >>> from jaxsched.plan import all_partitions
        >>> list(all_partitions(3))
        [[[0, 1, 2]], [[0, 1], [2]], [[0], [1, 2]], [[0], [1], [2]]]
    """
    for cuts in itertools.product((False, True), repeat=num_layers - 1):
        buckets, current = [], [0]
        for i, cut in enumerate(cuts, start=1):
            if cut:
                buckets.append(current)
                current = []
            current.append(i)
        buckets.append(current)
        yield buckets


def search(
    layers: LayerProfile,
    candidates: list[list[list[int]]],
    evaluate: Callable[[list[list[int]]], Any],
    progress: bool = False,
) -> list[list[int]]:
    """Best of ``candidates`` (exhaustive for small models), then greedy neighbour merges:
    for strategies without an exact dynamic programme, the simulator is the judge.

    Args:
      layers: the model's layers (only their number is read).
      candidates: partitions to try; ignored up to ``EXHAUSTIVE_LAYERS`` layers, where
        every partition is tried.
      evaluate: the cost of a partition (lower is better), e.g. a simulated iteration time.
      progress: show a progress bar over the candidates.

    Returns:
      The cheapest partition found, as forward-order buckets of layer indices.

    Raises:
      JaxschedValueError: there is nothing to search.

    Example:
        >>> from jaxsched.plan import search
        >>> from jaxsched.sim import Layer, LayerProfile, network_preset, simulate
        >>> prof = LayerProfile([Layer(str(i), 1, 10**6, 1e-3, 1e-3) for i in range(4)])
        >>> net = network_preset("10gbe", 8)
        >>> search(prof, [], lambda b: simulate(prof, net, "wfbp", b).iteration_s)
        [[0, 1], [2], [3]]
    """
    num = len(layers)
    if num <= EXHAUSTIVE_LAYERS:
        candidates = list(all_partitions(num))
    pool = {tuple(map(tuple, c)): c for c in candidates}
    iterator = pool.values()
    if progress:
        from jaxsched.core._progress import progress as progress_bar

        iterator = progress_bar(list(iterator), "optimal planner", unit="partition", leave=False)
    best: list[list[int]] | None = None
    best_time: Any = None
    for buckets in iterator:
        t = evaluate(buckets)
        if best_time is None or t < best_time:
            best, best_time = buckets, t
    if best is None:
        raise JaxschedValueError("no candidate bucket partitions to search")
    if num > EXHAUSTIVE_LAYERS and len(best) <= 64:
        improved = True
        while improved and len(best) > 1:
            improved = False
            for k in range(len(best) - 1):
                merged = best[:k] + [best[k] + best[k + 1]] + best[k + 2 :]
                t = evaluate(merged)
                if t < best_time:
                    best, best_time, improved = merged, t, True
                    break
    return best
