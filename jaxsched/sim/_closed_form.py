"""Closed-form steady-state iteration times for the base model (no cross-iteration overlap).

Why: they pin the event-driven simulator down. Under one compute stream and one FIFO
communication stream, an iteration of ``allreduce`` or bucketed ``wfbp`` is synchronous
(the next forward waits for the update, which waits for every collective), so its time
has a formula; the simulator must reproduce it exactly.

With forward total ``F``, update ``U``, buckets in backward order ``k = 1..K`` whose
gradients are ready ``r_k`` after backward starts and whose collective costs ``c_k``:

- allreduce: ``F + B + sum_k c_k + U`` (communication only after backward);
- wfbp: ``F + max_k (r_k + sum_{j >= k} c_j) + U`` (the unrolled FIFO recurrence
  ``E_k = max(E_{k-1}, r_k) + c_k``).

Example:
    >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
    >>> layers = LayerProfile([Layer("a", 1, 4000, 1e-3, 2e-3), Layer("b", 1, 4000, 1e-3, 2e-3)])
    >>> net = network_preset("1gbe", 2)
    >>> wfbp_time(layers, net) <= allreduce_time(layers, net, [[0], [1]])
    True
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxsched.sim._costmodel import LayerProfile, NetworkProfile
from jaxsched.sim._core import check_buckets

__all__ = ["allreduce_time", "wfbp_time"]


def _backward_buckets(
    layers: LayerProfile, network: NetworkProfile, buckets: Sequence[Sequence[int]]
) -> tuple[list[Any], list[Any]]:
    """Ready offsets (from backward start) and costs of each bucket, in backward order."""
    lay = layers.layers
    ready: list[Any] = []
    costs: list[Any] = []
    elapsed: Any = 0
    for bucket in reversed(check_buckets(buckets, len(lay))):
        for i in reversed(bucket):
            elapsed = elapsed + lay[i].backward_s
        ready.append(elapsed)
        costs.append(network.time("all_reduce", sum(lay[i].bytes for i in bucket)))
    return ready, costs


def allreduce_time(
    layers: LayerProfile, network: NetworkProfile, buckets: Sequence[Sequence[int]] | None = None
) -> Any:
    """Iteration time with no overlap: compute, then every bucket's all-reduce, then update.

    Args:
      layers: the model's layer profile (forward order).
      network: the network the all-reduces cross.
      buckets: layer indices per bucket (default: one bucket of every layer).

    Returns:
      Seconds per iteration: ``F + B + sum_k c_k + U``.

    Example:
        >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
        >>> layers = LayerProfile([Layer("a", 1, 4000, 1e-3, 2e-3), Layer("b", 1, 4000, 1e-3, 2e-3)])
        >>> round(allreduce_time(layers, network_preset("1gbe", 2)) * 1e3, 2)  # ms
        6.16
    """
    lay = layers.layers
    buckets = buckets if buckets is not None else [list(range(len(lay)))]
    _, costs = _backward_buckets(layers, network, buckets)
    return sum(l.forward_s for l in lay) + sum(l.backward_s for l in lay) + sum(costs) + sum(l.update_s for l in lay)


def wfbp_time(layers: LayerProfile, network: NetworkProfile, buckets: Sequence[Sequence[int]] | None = None) -> Any:
    """Iteration time of wait-free backpropagation: each bucket's all-reduce starts when its
    gradients are ready and the communication stream is free.

    Args:
      layers: the model's layer profile (forward order).
      network: the network the all-reduces cross.
      buckets: layer indices per bucket (default: one bucket per layer).

    Returns:
      Seconds per iteration: ``F + max_k (r_k + sum_{j >= k} c_j) + U``.

    Example:
        >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
        >>> layers = LayerProfile([Layer("a", 1, 4000, 1e-3, 2e-3), Layer("b", 1, 4000, 1e-3, 2e-3)])
        >>> round(wfbp_time(layers, network_preset("1gbe", 2)) * 1e3, 2)  # ms
        6.13
    """
    lay = layers.layers
    buckets = buckets if buckets is not None else [[i] for i in range(len(lay))]
    ready, costs = _backward_buckets(layers, network, buckets)
    suffix: Any = 0
    best: Any = None
    for r, c in zip(reversed(ready), reversed(costs)):
        suffix = suffix + c
        best = r + suffix if best is None else max(best, r + suffix)
    return sum(l.forward_s for l in lay) + best + sum(l.update_s for l in lay)
